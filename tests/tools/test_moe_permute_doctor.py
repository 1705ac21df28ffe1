"""``mcore-npu doctor``'s lines of the MoE permute operators: what ``auto`` runs on NPU tensors
with the installed torch_npu (a stand-in module here: no NPU on this machine), and why."""

from __future__ import annotations

from mcore_npu.tools import doctor
from tests.fused_standin import install

PERMUTE = "moe_token_permute_with_routing_map"


def test_no_torch_npu_means_the_reference():
    check = doctor.check_operator(PERMUTE, doctor._probe_torch())
    assert check.status == doctor.OK and "reference" in check.detail


def test_a_torch_npu_with_the_pair_takes_the_fused_operators(monkeypatch):
    install(monkeypatch)
    for name in (PERMUTE, "moe_token_unpermute_with_routing_map", "moe_token_permute"):
        check = doctor.check_operator(name, doctor._probe_torch())
        assert check.status == doctor.OK and check.detail == "auto on NPU tensors -> torch_npu"


def test_an_older_torch_npu_falls_back_and_the_line_says_why(monkeypatch):
    install(monkeypatch, routing_map_ops=False)
    check = doctor.check_operator(PERMUTE, doctor._probe_torch())
    assert "-> reference (torch_npu: the installed torch_npu has no " in check.detail
    assert "npu_moe_token_permute_with_routing_map" in check.detail
    legacy = doctor.check_operator("moe_token_permute", doctor._probe_torch())
    assert legacy.detail == "auto on NPU tensors -> torch_npu"
