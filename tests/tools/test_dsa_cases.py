"""``mcore-npu verify`` on specs/dsa_cases.yaml: DeepSeek Sparse Attention's table (indexer and
sparse attention) against the float64 oracles of ``mcore_npu.tools.dsa_cases``, and planted
errors that the comparisons must catch. No NPU here: oracle mode, plus the hardware-mode check
on the CPU (``auto`` picks the reference there)."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_npu.cli import main
from mcore_npu.ops.dsa import attention, indexer
from mcore_npu.tools import dsa_cases, verify
from tests.launch import ROOT

TABLE = str(ROOT / "specs" / "dsa_cases.yaml")
CASES = {case.id: case for case in dsa_cases.load_dsa_cases(TABLE)}
ORACLE = verify.Target(torch.device("cpu"), hardware=False)


def test_verify_runs_the_dsa_table_against_the_oracle(capsys):
    assert main(["verify", "--cases", TABLE, "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "oracle" and report["summary"]["failed"] == 0
    results = {r["id"]: r for r in report["results"]}
    assert set(results) == set(CASES) and len(results) == 44
    for case_id, result in results.items():
        case = CASES[case_id]
        if case.operator == "lightning_indexer":
            wanted = {"forward", "indices"}
        else:
            wanted = {"forward", "grad0", "grad1", "grad2"}
            wanted |= {"grad3", "grad4"} if case.param("rope") else set()
        assert {k for k, v in result.items() if isinstance(v, dict)} == wanted, case_id
        assert all(result[name]["compared"] > 0 for name in wanted), case_id


def test_the_table_covers_what_the_issue_names():
    entries = {(c.operator, c.param("name")): dict(c.params) for c in CASES.values()}
    for operator in dsa_cases.OPERATORS:
        mine = [p for (op, _), p in entries.items() if op == operator]
        assert {p["layout"] for p in mine} == {"BSND", "TND"}
        assert {p["mode"] for p in mine} == {0, 3}
        packed = [p["segments"] for p in mine if p["layout"] == "TND"]
        assert {len(s) for s in packed} == {2, 3}
        assert all(len({q for q, _ in s}) == len(s) for s in packed)  # unequal lengths
        longest = [max(max(pair) for pair in p.get("segments") or [p["seq"]]) for p in mine]
        assert any(p["top_k"] < n for p, n in zip(mine, longest))
        assert any(p["top_k"] > n for p, n in zip(mine, longest))
        assert any(max(p.get("seq", (0,))) > 128 for p in mine)  # QUERY_BLOCK
    ropes = {bool(p.get("rope")) for (op, _), p in entries.items() if op.startswith("sparse")}
    assert ropes == {True, False}
    fp32 = [c for c in CASES.values() if c.dtype == torch.float32]
    assert fp32 and all(c.grad.rtol <= 1e-5 and c.forward.rtol <= 1e-5 for c in fp32)


def _planted(monkeypatch, module, name, wrong):
    """Replace ``module.name`` (what the operator calls) by ``wrong(original, *args, **kw)``."""
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: wrong(original, *a, **k))


def test_a_selection_missing_its_best_key_is_counted(monkeypatch):
    """The indexer's best key swapped for the first one it left out: every query with a key
    left out counts, and the values then differ too."""

    def swap_best(original, *args, **kwargs):
        indices, values = original(*args, **kwargs)
        ranked, _ = original(*args, **{**kwargs, "sparse_count": kwargs["sparse_count"] + 1})
        left_out = ranked[..., -1]
        indices[..., 0] = torch.where(left_out >= 0, left_out, indices[..., 0])
        return indices, values

    _planted(monkeypatch, indexer, "indexer_reference", swap_best)
    result = ORACLE.check(CASES["lightning_indexer/tnd_k_below/float32"])
    counts = {c.name: c for c in result.comparisons}
    assert not result.passed and counts["indices"].max_error > 0
    assert counts["indices"].compared == 9 + 23 + 14


def test_an_index_across_a_packed_boundary_is_a_problem(monkeypatch):
    def past_the_end(original, *args, **kwargs):
        indices, values = original(*args, **kwargs)
        indices[-1, 0, 0] = 14  # the last sequence has 14 keys: 14 is the next sequence's
        return indices, values

    _planted(monkeypatch, indexer, "indexer_reference", past_the_end)
    result = ORACLE.check(CASES["lightning_indexer/tnd_k_below/float32"])
    assert not result.passed
    assert result.problems == ("query 45 (sequence of 14 keys) selects [14]",)


class _ScaledGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


@pytest.mark.parametrize("leaf, column", [("key", "grad1"), ("key_rope", "grad4")])
def test_a_gradient_off_by_1e_4_relative_fails_its_column_only(monkeypatch, leaf, column):
    def off(original, *args, **kwargs):
        args = list(args)
        if leaf == "key":
            args[1] = _ScaledGrad.apply(args[1], 1 + 1e-4)
        else:
            kwargs[leaf] = _ScaledGrad.apply(kwargs[leaf], 1 + 1e-4)
        return original(*args, **kwargs)

    _planted(monkeypatch, attention, "sparse_attention_reference", off)
    result = ORACLE.check(CASES["sparse_flash_attention/tnd_rope/float32"])
    failed = [c.name for c in result.comparisons if not c.passed]
    assert failed == [column]


def test_a_dropped_key_fails_the_forward(monkeypatch):
    def drop_first(original, query, key, value, indices, *args, **kwargs):
        indices = indices.clone()
        indices[..., 0] = -1
        return original(query, key, value, indices, *args, **kwargs)

    _planted(monkeypatch, attention, "sparse_attention_reference", drop_first)
    result = ORACLE.check(CASES["sparse_flash_attention/bsnd_lengths/float32"])
    assert not result.passed and result.error("forward") > 1e-3


@pytest.mark.parametrize(
    "case_id",
    ["lightning_indexer/bsnd_lengths/bfloat16", "sparse_flash_attention/tnd_mode0/bfloat16"],
)
def test_hardware_mode_on_the_cpu_compares_auto_with_the_float32_reference(case_id):
    """``auto`` runs the reference on the CPU: in the case's dtype, against float32."""
    result = verify.Target(torch.device("cpu"), hardware=True).check(CASES[case_id])
    assert result.passed, result
    assert result.error("forward") > 0  # bfloat16 against float32: not the same numbers
