"""specs/fused_ops_cases.yaml: every case passes reference vs float64 oracle, and the table
covers every documented argument of the three operators."""

from __future__ import annotations

import pytest

from mcore_npu.tools.fused_cases import (
    FusedCase,
    check_kernel_fused_case,
    check_reference_fused_case,
    load_fused_cases,
)
from tests.fused_standin import install

CASES = load_fused_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reference_matches_the_float64_oracle(case: FusedCase):
    result = check_reference_fused_case(case)
    assert result.passed, result
    assert [c.name for c in result.comparisons] == ["forward", "grad0", *(
        ["grad1"] if case.operator != "npu_swiglu" and case.param("probs", True) else [])]  # fmt: skip


def test_the_table_covers_every_documented_argument():
    gmm = [dict(c.params) for c in CASES if c.operator == "npu_grouped_matmul"]
    assert {p["group_type"] for p in gmm} == {None, 0, 2}
    assert {p["group_list_type"] for p in gmm} == {0, 1}
    assert {p["split_item"] for p in gmm} >= {0, 2, 3}
    assert any(0 in p["counts"] for p in gmm if p["group_type"] == 0)
    assert any(0 in p["counts"] for p in gmm if p["group_type"] == 2)
    assert any(p.get("weight_3d") for p in gmm)
    assert any(p.get("bias") for p in gmm if p["group_type"] == 0)
    norms = [dict(c.params) for c in CASES if c.operator == "npu_rms_norm"]
    assert {p["gamma_rank"] for p in norms} == {1, 2}
    assert len({p["epsilon"] for p in norms}) >= 2
    glus = [dict(c.params) for c in CASES if c.operator == "npu_swiglu"]
    assert {p["dim"] for p in glus} >= {-1, 0, 1}
    assert {str(c.dtype) for c in CASES} == {"torch.float32", "torch.float16", "torch.bfloat16"}


def test_kernel_mode_calls_torch_npu_with_the_case_arguments(monkeypatch):
    standin = install(monkeypatch)  # no NPU here: the stand-in answers with the reference
    case = next(c for c in CASES if c.id == "npu_grouped_matmul/split_k_weight_grad/float32")
    result = check_kernel_fused_case(case, "cpu")
    assert result.passed
    ((name, _, kwargs),) = standin.calls
    assert name == "npu_grouped_matmul"
    assert (kwargs["group_type"], kwargs["split_item"], kwargs["group_list_type"]) == (2, 3, 1)
    assert kwargs["group_list"].tolist() == [7, 0, 5]
