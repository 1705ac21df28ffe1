"""``mcore-npu verify`` on the fused-operator table and ``doctor``'s fused-ops line.

torch_npu here is a stand-in module in sys.modules (no NPU on this machine)."""

from __future__ import annotations

import json

import pytest

from mcore_npu.cli import main
from mcore_npu.tools import doctor, permute_cases
from tests.fused_standin import FusedOpsTorchNpu, install
from tests.launch import ROOT

TABLE = str(ROOT / "specs" / "fused_ops_cases.yaml")


def test_verify_runs_the_fused_table_against_the_oracle(capsys):
    assert main(["verify", "--cases", TABLE, "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "oracle" and report["summary"]["failed"] == 0
    ids = [r["id"] for r in report["results"]]
    assert len(ids) == report["summary"]["cases"] >= 45
    assert {i.split("/")[0] for i in ids} == {
        "npu_rms_norm",
        "npu_swiglu",
        "npu_grouped_matmul",
        "npu_rotary_mul",
        *permute_cases.OPERATORS,
    }
    assert all({"forward", "grad0"} <= set(r) for r in report["results"])


def test_verify_text_output_has_fused_columns_and_filters(capsys):
    assert main(["verify", "--cases", TABLE, "--filter", "npu_swiglu/last"]) == 0
    out = capsys.readouterr().out
    assert "grad0" in out and "dq" not in out
    assert "3 cases: 3 passed, 0 failed" in out


def test_doctor_says_no_torch_npu_means_references():
    for name in ("rms_norm", "swiglu", "grouped_matmul", "rotary_mul"):
        check = doctor.check_operator(name, doctor._probe_torch())
        assert check.status == doctor.OK and "reference" in check.detail


@pytest.mark.parametrize("old", [False, True])
def test_doctor_says_what_auto_runs_with_the_installed_torch_npu(monkeypatch, old):
    """The stand-in has every fused operator; an older release's npu_grouped_matmul takes no
    group_type: auto then takes the reference, and the line says why (the registry's reason)."""
    standin = install(monkeypatch, old_signature=old)
    assert isinstance(standin, FusedOpsTorchNpu)
    probe = doctor._probe_torch()
    for name in ("rms_norm", "swiglu"):
        assert doctor.check_operator(name, probe).detail == "auto on NPU tensors -> torch_npu"
    check = doctor.check_operator("grouped_matmul", probe)
    assert check.status == doctor.OK  # no NPU on this machine: nothing runs on one
    assert ("-> reference" in check.detail and "takes no ['group_list_type', 'group_type']"
            in check.detail) == old  # fmt: skip
    attention = doctor.check_operator("fusion_attention", probe)
    assert "-> reference (torch_npu: the installed torch_npu has no npu_fusion_attention)" in (
        attention.detail
    )


@pytest.mark.parametrize("old", [False, True])
def test_doctor_says_whether_npu_rotary_mul_takes_rotary_mode(monkeypatch, old):
    install(monkeypatch, old_rotary=old)
    check = doctor.check_operator("rotary_mul", doctor._probe_torch())
    assert check.detail.startswith("auto on NPU tensors -> torch_npu, interleaved -> ")
    assert ("interleaved -> reference (torch_npu: rotary_mode 'interleave' needs an "
            "npu_rotary_mul that takes rotary_mode" in check.detail) == old  # fmt: skip
