"""specs/gated_delta_cases.yaml: the table covers what the operators take, its cases pass
reference vs float64 oracle, and ``verify``'s hardware mode calls the kernel ``auto`` picks.

The full table (34 cases) runs in ``mcore-npu verify --cases specs/gated_delta_cases.yaml``; here
the cheaper half runs (the long fp32 rule cases repeat tests/ops/test_gated_delta.py)."""

from __future__ import annotations

import pytest
import torch

from mcore_npu.tools import verify
from mcore_npu.tools.gdn_cases import (
    GatedDeltaCase,
    check_kernel_gdn_case,
    check_reference_gdn_case,
    load_gated_delta_cases,
)
from tests.gated_delta_standin import install_torch_npu

CASES = load_gated_delta_cases()
LONG = ("long_gva", "chunk_plus_one", "one_chunk", "chunk_minus_one")
QUICK = [c for c in CASES if not any(f"/{name}/" in c.id for name in LONG)]


@pytest.mark.parametrize("case", QUICK, ids=[c.id for c in QUICK])
def test_reference_matches_the_float64_oracle(case: GatedDeltaCase):
    result = check_reference_gdn_case(case)
    assert result.passed, result
    names = [c.name for c in result.comparisons]
    assert names[0] == "forward" and ("state" in names) == (
        case.operator == "chunk_gated_delta_rule"
    )
    if not case.param("no_grad"):
        assert names[-1] == {"chunk_gated_delta_rule": "grad5" if case.param("initial") else "grad4",
                             "causal_conv1d": "grad2" if case.param("bias") else "grad1", "l2norm": "grad0",
                             "gated_rms_norm": "grad2"}[case.operator]  # fmt: skip


def test_the_table_covers_the_operator_contract():
    rule = [dict(c.params) for c in CASES if c.operator == "chunk_gated_delta_rule"]
    assert {p.get("tokens") for p in rule} >= {1, 63, 64, 65, 200}
    assert any(p["heads"][1] > p["heads"][0] for p in rule)  # GVA
    assert any(p["dims"][0] != p["dims"][1] for p in rule)  # K != V
    assert any(p.get("segments") for p in rule) and any(p.get("strong") for p in rule)
    assert {p["l2norm"] for p in rule} == {True, False} and {p["initial"] for p in rule} == {
        True, False}  # fmt: skip
    assert any(p.get("no_grad") and p["dims"] == (128, 128) for p in rule)
    conv = [c for c in CASES if c.operator == "causal_conv1d"]
    assert any(c.param("segments") for c in conv) and any(c.param("bias") for c in conv)
    assert {str(c.dtype) for c in CASES} == {"torch.float32", "torch.bfloat16"}


def test_verify_reads_the_table():
    cases = verify.select_cases(str(verify.Path("specs/gated_delta_cases.yaml")), "l2norm/heads")
    assert [c.id for c in cases] == ["l2norm/heads/float32", "l2norm/heads/bfloat16"]


def test_kernel_mode_runs_the_forward_only_kernel_under_no_grad(monkeypatch):
    """Hardware mode on a stand-in: CPU tensors, so ``auto`` would pick the reference; the
    stand-in torch_npu is reached by naming it through a patched choice (no NPU here)."""
    rec = install_torch_npu(monkeypatch)
    from mcore_npu.ops.gated_delta import rule

    monkeypatch.setattr(rule, "choose_kernel", lambda kernel, *a, **k: (
        "torch_npu" if kernel == "auto" else kernel))  # fmt: skip
    case = next(c for c in CASES if c.id == "chunk_gated_delta_rule/forward_only/bfloat16")
    result = check_kernel_gdn_case(case, "cpu")
    assert result.passed, result
    assert rec.names() == ["npu_chunk_gated_delta_rule"]
    assert torch.is_grad_enabled()
