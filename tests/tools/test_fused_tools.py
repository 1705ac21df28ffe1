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
    check = doctor.check_fused_ops(doctor._probe_torch())
    assert check.status == doctor.OK and "reference" in check.detail


@pytest.mark.parametrize("old", [False, True])
def test_doctor_lists_the_operators_the_installed_torch_npu_has(monkeypatch, old):
    standin = install(monkeypatch, old_signature=old)
    assert isinstance(standin, FusedOpsTorchNpu)
    check = doctor.check_fused_ops(doctor._probe_torch())
    assert "npu_rms_norm, npu_swiglu, npu_grouped_matmul" in check.detail
    assert check.status == doctor.WARN and "missing npu_fusion_attention" in check.detail
    assert ("older signature" in check.detail) == old
    assert "fused.<op>: reference" in check.fix


@pytest.mark.parametrize("old", [False, True])
def test_doctor_says_whether_npu_rotary_mul_takes_rotary_mode(monkeypatch, old):
    install(monkeypatch, old_rotary=old)
    check = doctor.check_fused_ops(doctor._probe_torch())
    assert "npu_rotary_mul" in check.detail.split(";")[0]  # it is among the operators found
    assert ("npu_rotary_mul takes rotary_mode" in check.detail) != old
    assert ("npu_rotary_mul is the older signature" in check.detail) == old
