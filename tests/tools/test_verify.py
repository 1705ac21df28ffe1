"""``mcore-npu verify``: the case table on the CPU (reference vs the float64 oracle), the
comparison that excludes invalid rows, and the hardware path driven by a stand-in torch_npu on
the CPU (it calls the reference, then optionally spoils the answer)."""

from __future__ import annotations

import json
import os
import re
import sys
import types

import pytest
import torch

from mcore_npu.allocator.device import is_npu_available
from mcore_npu.cli import main
from mcore_npu.ops.reference import npu_fusion_attention as reference_op
from mcore_npu.ops.reference import npu_fusion_attention_grad as npu_fusion_attention_grad_reference
from mcore_npu.tools import verify
from mcore_npu.tools.cases import Tolerance, load_cases, make_inputs
from tests.launch import ROOT, run_command
from tests.ops.oracle import oracle as elementwise_oracle

REPO = ROOT
CASES = {case.id: case for case in load_cases()}
# Mode 3 with Sq=19 > Skv=7: query rows 0..11 keep no key (invalid), rows 12..18 are valid.
INVALID_ROWS_CASE = "BNSD/causal_bottom_right/MHA/q_longer/float32"
SUMMARY = re.compile(r"^(\d+) cases: (\d+) passed, (\d+) failed$")

needs_no_npu = pytest.mark.skipif(is_npu_available(), reason="an NPU is present here")


def _summary(out: str) -> tuple[int, int, int]:
    match = SUMMARY.match(out.strip().splitlines()[-1])
    assert match, out[-500:]
    return tuple(int(n) for n in match.groups())


# --------------------------------------------------------------------------------------------
# the command on the CPU
# --------------------------------------------------------------------------------------------


@needs_no_npu
def test_filtered_run_passes_and_says_the_hardware_was_skipped(capsys):
    assert main(["verify", "--filter", "TND/causal_bottom_right"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == verify.NO_NPU_NOTE
    rows = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    # 27 of the main grid (3 groupings x 3 lengths x 3 dtypes), 6 with Dv < D (MHA, 3 x 2)
    assert len(rows) == 33 and all(row.startswith("PASS") for row in rows)
    assert sum("/Dv8" in row for row in rows) == 6
    assert all(len(row.split()) == 6 for row in rows)  # status, id, forward, dq, dk, dv
    assert _summary(out) == (33, 33, 0)


def test_json_run_reports_every_quantity(capsys):
    assert main(["verify", "--device", "cpu", "--filter", "BSH/dense_per_head/GQA", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "oracle" and report["device"] == "cpu"
    assert report["summary"]["cases"] == 9 and report["summary"]["failed"] == 0
    for result in report["results"]:
        assert result["passed"] and result["problems"] == []
        for name in verify.QUANTITIES:
            entry = result[name]
            assert 0 <= entry["max_error"] <= entry["bound"] and entry["compared"] > 0


def test_unknown_filter_is_a_usage_error(capsys):
    assert main(["verify", "--filter", "no/such/case"]) == 2
    assert "no case id contains it" in capsys.readouterr().err


def test_missing_case_table_is_a_usage_error(tmp_path, capsys):
    assert main(["verify", "--cases", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


@needs_no_npu
def test_explicit_npu_device_without_an_npu_is_refused(capsys):
    assert main(["verify", "--device", "npu:0", "--filter", "BSH/full/MHA/equal"]) == 2
    err = capsys.readouterr().err
    assert "no usable NPU" in err and "mcore-npu doctor" in err


def test_subprocess_run():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = run_command(
        [sys.executable, "-m", "mcore_npu", "verify", "--device", "cpu", "--filter", "SBH/prefix"],
        cwd=REPO,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert _summary(result.stdout) == (54, 54, 0)
    assert result.stderr == ""


@pytest.mark.slow
def test_full_table_passes_on_the_cpu(capsys):
    """Every case (about 4 s on two cores)."""
    assert main(["verify", "--device", "cpu"]) == 0
    total = len(CASES)
    assert _summary(capsys.readouterr().out) == (total, total, 0)


# --------------------------------------------------------------------------------------------
# the comparison
# --------------------------------------------------------------------------------------------

TOL = Tolerance(atol=1e-6, rtol=1e-5)


def test_compare_reports_the_max_error_of_a_wrong_output():
    want = torch.ones(2, 3, 4, dtype=torch.float64)
    got = want.clone()
    got[1, 2, 3] += 0.25
    got[0, 0, 0] -= 0.125
    result = verify.compare("forward", got.float(), want, None, TOL)
    assert not result.passed
    assert result.max_error == pytest.approx(0.25)
    assert result.bound == pytest.approx(1e-6 + 1e-5)
    assert result.compared == 24


def test_compare_ignores_invalid_rows():
    want = torch.randn(2, 5, 8, dtype=torch.float64)
    valid = torch.ones_like(want, dtype=torch.bool)
    valid[:, :2] = False  # rows 0 and 1 of every batch keep no key
    got = want.clone()
    got[:, :2] = torch.nan  # whatever a kernel writes there
    result = verify.compare("forward", got, want, valid, TOL)
    assert result.passed and result.max_error == 0.0 and result.compared == 2 * 3 * 8
    got[0, 4, 7] = torch.nan  # a NaN on a valid row fails
    assert not verify.compare("forward", got, want, valid, TOL).passed


def test_compare_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="shape"):
        verify.compare("dq", torch.zeros(2, 3), torch.zeros(3, 2), None, TOL)


def test_invalid_rows_of_a_real_case_come_from_the_oracle():
    case = CASES[INVALID_ROWS_CASE]
    inputs = make_inputs(case, requires_grad=False)
    truth = verify.oracle(*inputs.call_args(), **inputs.op_kwargs)
    rows_valid = truth.valid_out[0, 0, :, 0]  # BNSD: [B, N, Sq, Dv]
    assert rows_valid.tolist() == [False] * 12 + [True] * 7
    spoiled = truth.out.clone()
    spoiled[..., :12, :] = 123.0  # differs only on invalid rows
    assert verify.compare("forward", spoiled, truth.out, truth.valid_out, case.forward).passed
    spoiled[1, 3, 12, 0] += 0.5  # and now on a valid one
    result = verify.compare("forward", spoiled, truth.out, truth.valid_out, case.forward)
    assert not result.passed and result.max_error == pytest.approx(0.5)


def _one_case_per_layout_and_mode():
    chosen = {}
    for case in CASES.values():
        if case.dtype == "float32":
            chosen.setdefault((case.layout, case.mode.name), case)
    return list(chosen.values())


@pytest.mark.parametrize("case", _one_case_per_layout_and_mode(), ids=lambda c: c.id)
def test_oracle_agrees_with_the_tests_elementwise_oracle(case):
    """verify's vectorised oracle against tests/ops/oracle.py (pair by pair in Python)."""
    inputs = make_inputs(case, dtype=torch.float64, requires_grad=False)
    mine = verify.oracle(*inputs.call_args(), **inputs.op_kwargs)
    theirs, valid = elementwise_oracle(*inputs.call_args(), **inputs.op_kwargs)
    assert torch.equal(mine.valid_out, valid)
    torch.testing.assert_close(mine.out, theirs, rtol=1e-12, atol=1e-12)


def test_reference_check_flags_non_zero_invalid_rows(monkeypatch):
    """In oracle mode the reference must give exactly 0 on invalid rows."""
    real = verify.fusion_attention

    def leaky(*args, **kwargs):
        return real(*args, **kwargs) + 1e-3  # differentiable, spoils every row a little

    monkeypatch.setattr(verify, "fusion_attention", leaky)
    result = verify.check_reference_case(CASES[INVALID_ROWS_CASE])
    assert not result.passed
    assert "the output is not 0 on invalid (fully masked) rows" in result.problems
    assert result.comparisons[0].max_error == pytest.approx(1e-3, rel=1e-3)


# --------------------------------------------------------------------------------------------
# the hardware path, with a stand-in torch_npu running on the CPU
# --------------------------------------------------------------------------------------------


def _stand_in(spoil=None, spoil_grad=None) -> types.ModuleType:
    """A ``torch_npu`` whose kernels are the references; ``spoil(out, query, key, value)`` and
    ``spoil_grad(dq)`` may change the answers."""
    module = types.ModuleType("torch_npu")

    def npu_fusion_attention_grad(*args, **kwargs):
        dq, dk, dv, dpse = npu_fusion_attention_grad_reference(*args, **kwargs)
        return (dq if spoil_grad is None else spoil_grad(dq)), dk, dv, dpse

    module.npu_fusion_attention_grad = npu_fusion_attention_grad

    def npu_fusion_attention(query, key, value, *args, **kwargs):
        result = reference_op(query, key, value, *args, **kwargs)
        out = result[0] if spoil is None else spoil(result[0], query, key, value)
        return (out, *result[1:])

    module.npu_fusion_attention = npu_fusion_attention
    return module


@pytest.fixture
def pretend_npu(monkeypatch):
    """Make verify believe an NPU is present, with its 'device' being the CPU."""
    monkeypatch.setattr(verify.accelerators, "is_npu_available", lambda: True)
    monkeypatch.setattr(verify.accelerators, "current_device", lambda: torch.device("cpu"))

    def install(module):
        monkeypatch.setitem(sys.modules, "torch_npu", module)

    return install


def test_hardware_path_passes_a_correct_kernel(pretend_npu, capsys):
    pretend_npu(_stand_in())
    assert main(["verify", "--filter", "causal_bottom_right/MHA/q_longer"]) == 0
    out = capsys.readouterr().out
    assert "mode hardware" in out and verify.NO_NPU_NOTE not in out
    assert _summary(out) == (25, 25, 0)  # 15 of the main grid, 10 with Dv < D (ids .../Dv8)


def test_hardware_path_ignores_what_the_kernel_does_on_invalid_rows(pretend_npu):
    """Invalid rows as a large-negative fill gives them: the mean of V (a uniform softmax).

    That output depends on V, so dv would differ too if the upstream gradient were not zero on
    those rows; the case must pass all the same.
    """

    def mean_of_v_on_invalid_rows(out, query, key, value):  # BNSD [B, N, 19, Dv]: rows 0..11
        uniform = value.mean(-2, keepdim=True).expand(*out.shape[:-2], 12, out.shape[-1])
        return torch.cat([uniform, out[..., 12:, :]], dim=-2)

    pretend_npu(_stand_in(mean_of_v_on_invalid_rows))
    result = verify.check_kernel_case(CASES[INVALID_ROWS_CASE], "cpu")
    assert result.passed, result


def test_hardware_path_fails_a_wrong_gradient_operator(pretend_npu):
    """Only the explicit gradient operator is wrong: op-dq fails, dq (autograd) passes."""
    pretend_npu(_stand_in(spoil_grad=lambda dq: dq + 0.01))
    result = verify.check_kernel_case(CASES[INVALID_ROWS_CASE], "cpu")
    failed = {c.name for c in result.comparisons if not c.passed}
    assert failed == {"op-dq"}, result


def test_hardware_path_fails_a_wrong_kernel_with_its_max_error(pretend_npu, capsys):
    pretend_npu(_stand_in(lambda out, *_: out + 0.01))
    assert main(["verify", "--filter", INVALID_ROWS_CASE]) == 1
    captured = capsys.readouterr()
    assert _summary(captured.out) == (2, 0, 2)  # the case and its Dv < D twin (.../Dv8)
    fail_row = next(line for line in captured.out.splitlines() if line.startswith("FAIL"))
    assert fail_row.split()[2] == "1.0e-02!"  # forward, flagged
    assert "forward: max error 1.000e-02 > bound" in captured.out
    assert captured.err.strip() == "mcore-npu verify: 2 cases: 0 passed, 2 failed"


def test_hardware_path_compares_gradients_too(pretend_npu):
    def wrong_gradient(out, *_):  # same forward, doubled gradient
        return 2 * out - out.detach()

    pretend_npu(_stand_in(wrong_gradient))
    result = verify.check_kernel_case(CASES["BSH/full/GQA/equal/bfloat16"], "cpu")
    failed = {c.name for c in result.comparisons if not c.passed}
    assert failed == {"dq", "dk", "dv"}


def test_a_kernel_that_raises_fails_only_its_case(pretend_npu):
    def explode(out, *_):
        raise RuntimeError("aclnnFlashAttentionScore failed\nmore detail")

    pretend_npu(_stand_in(explode))
    results = verify.run_cases([CASES[INVALID_ROWS_CASE]], verify.Target("cpu", True).check)
    assert results[0].problems == ("RuntimeError: aclnnFlashAttentionScore failed",)
