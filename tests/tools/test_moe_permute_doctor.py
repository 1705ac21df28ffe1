"""``mcore-npu doctor``'s "moe permute" line: which of the four permute operators torch_npu has
and the path ``auto`` takes (torch_npu is a stand-in module here: no NPU on this machine)."""

from __future__ import annotations

from mcore_npu.tools import doctor
from tests.fused_standin import install


def test_no_torch_npu_means_the_reference():
    check = doctor.check_moe_permute(doctor._probe_torch())
    assert check.status == doctor.OK and "reference" in check.detail


def test_a_torch_npu_with_the_pair_takes_the_fused_operators(monkeypatch):
    install(monkeypatch)
    check = doctor.check_moe_permute(doctor._probe_torch())
    assert check.status == doctor.OK
    assert "npu_moe_token_permute_with_routing_map" in check.detail
    assert "npu_moe_token_unpermute" in check.detail
    assert "auto on NPU -> the fused operators" in check.detail


def test_an_older_torch_npu_falls_back_with_a_warning_line(monkeypatch):
    install(monkeypatch, routing_map_ops=False)
    check = doctor.check_moe_permute(doctor._probe_torch())
    assert check.status == doctor.WARN
    assert "with_routing_map" not in check.detail.split(";")[0]  # only the legacy pair listed
    assert "unfused permute" in check.detail and "upgrade torch-npu" in check.fix
