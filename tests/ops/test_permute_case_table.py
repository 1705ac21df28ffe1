"""The MoE permute part of specs/fused_ops_cases.yaml: it covers the operators' arguments, and
``verify``'s kernel mode calls both operators of a pair on torch_npu (a stand-in here: no NPU;
``tests/fused_standin.py`` records the calls and answers with the reference)."""

from __future__ import annotations

from mcore_npu.tools import permute_cases
from mcore_npu.tools.fused_cases import check_kernel_fused_case, load_fused_cases
from tests.fused_standin import install

CASES = [c for c in load_fused_cases() if c.operator in permute_cases.OPERATORS]


def test_the_table_covers_the_permute_arguments():
    assert {c.operator for c in CASES} == set(permute_cases.OPERATORS)
    for operator in (permute_cases.PERMUTE, permute_cases.UNPERMUTE):
        params = [dict(c.params) for c in CASES if c.operator == operator]
        assert {p["probs"] for p in params} == {True, False}
        assert any(p.get("capacity") for p in params)  # drop_and_pad
        assert any(p.get("density") for p in params)  # tokens routed to 0..E experts
    legacy = [dict(c.params) for c in CASES if c.operator == permute_cases.LEGACY_UNPERMUTE]
    assert any(p.get("num_out_tokens") for p in legacy)


def test_kernel_mode_runs_the_round_trip_on_torch_npus_pair(monkeypatch):
    standin = install(monkeypatch)
    case = next(c for c in CASES if c.id.startswith(
        "npu_moe_token_unpermute_with_routing_map/drop_and_pad_weighted/float32"))  # fmt: skip
    assert check_kernel_fused_case(case, "cpu").passed
    assert standin.names() == [permute_cases.PERMUTE, permute_cases.UNPERMUTE]
    (_, _, permute_kwargs), (_, _, unpermute_kwargs) = standin.calls
    assert permute_kwargs["drop_and_pad"] is True and permute_kwargs["num_out_tokens"] == 12
    assert unpermute_kwargs["probs"] is not None and unpermute_kwargs["drop_and_pad"] is True


def test_kernel_mode_legacy_pair(monkeypatch):
    standin = install(monkeypatch)
    case = next(c for c in CASES if c.id == "npu_moe_token_unpermute/top2_dropped/float32")
    assert check_kernel_fused_case(case, "cpu").passed
    assert standin.names() == ["npu_moe_token_permute", "npu_moe_token_unpermute"]
    assert standin.calls[0][2]["num_out_tokens"] == 25
