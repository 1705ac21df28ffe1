"""``mcore-npu doctor``: the report on this machine, in-process and as a subprocess, and against
stand-in broken torch_npu packages (no CANN here, so a fake one raises the real error text)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from mcore_npu.cli import main
from mcore_npu.ops.registry import OPERATORS
from mcore_npu.tools import doctor
from tests.launch import ROOT, run_command

REPO = ROOT
LIBHCCL_ERROR = "libhccl.so: cannot open shared object file: No such file or directory"
NAMES = [
    "python",
    "torch",
    "megatron-core",
    "torch-npu",
    "cann",
    "transformer-engine",
    "accelerator",
    "allocator env",
    "allocator setter",
    "attention",
    "mla value",
    *(f"op {name}" for name in OPERATORS),
]
ENV_NOISE = (
    "PYTORCH_NPU_ALLOC_CONF",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "PYTHONPATH",
)


@pytest.fixture
def clean_env(monkeypatch):
    """No allocator configuration or autoload switch inherited from the caller's shell."""
    for name in ENV_NOISE:
        monkeypatch.delenv(name, raising=False)


def _doctor_subprocess(pythonpath: Path | None = None, *args: str, **extra_env: str):
    env = {k: v for k, v in os.environ.items() if k not in ENV_NOISE}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    env.update(extra_env)
    return run_command(
        [sys.executable, "-m", "mcore_npu", "doctor", *args],
        cwd=REPO,
        env=env,
    )


def _stand_in_torch_npu(root: Path, *, distribution: str | None = None) -> Path:
    """A ``torch_npu`` package under ``root`` whose import fails like torch_npu without CANN.

    With ``distribution`` (a version), also a ``.dist-info`` declaring torch's
    ``torch.backends`` entry point, as the real wheel does: then torch autoloads it.
    """
    package = root / "torch_npu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"raise ImportError({LIBHCCL_ERROR!r})\n")
    if distribution is not None:
        info = root / f"torch_npu-{distribution}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: torch-npu\nVersion: {distribution}\n"
        )
        (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_load\n")
    return root


# --------------------------------------------------------------------------------------------
# this machine
# --------------------------------------------------------------------------------------------


def test_doctor_reports_every_check_aligned(clean_env, capsys):
    code = main(["doctor"])
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if not line.startswith(" ")]
    assert [line.split(":", 1)[0] for line in lines] == [*NAMES, "summary"]
    value_columns = {len(line) - len(line.split(":", 1)[1].lstrip()) for line in lines}
    assert len(value_columns) == 1, "values must start in one column"
    healthy = all(" ERROR " not in f" {line.split(':', 1)[1]} " for line in lines)
    assert code == (0 if healthy else 1)
    if code == 0:
        assert err == "" and "healthy" in lines[-1]


def test_doctor_json_lists_checks_with_status_and_detail(clean_env, capsys):
    code = main(["doctor", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in report["checks"]] == NAMES
    for check in report["checks"]:
        assert check["status"] in ("ok", "warn", "error")
        assert check["detail"]
        if check["status"] != "ok":
            assert check["cause"] and check["fix"], check
    assert report["healthy"] is (code == 0)
    torch_check = report["checks"][1]
    assert torch_check["status"] == "ok" and "build" in torch_check["detail"]


def test_cpu_machine_without_torch_npu_is_healthy(clean_env, capsys):
    if doctor._module_origin("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch-npu:" in out and "not installed" in out
    assert "kernel reference" in out


@pytest.mark.slow
def test_doctor_subprocess_exits_zero_on_this_machine():
    if doctor._module_origin("torch_npu") is not None:
        pytest.skip("torch_npu is installed here; its health decides the exit code")
    result = _doctor_subprocess()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "summary:" in result.stdout and "healthy" in result.stdout
    assert "mcore-npu doctor:" not in result.stderr


# --------------------------------------------------------------------------------------------
# stand-in broken torch_npu
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bare_torch_npu_package_does_not_break_import_torch(tmp_path):
    """torch autoloads backends from installed distributions' entry points only."""
    _stand_in_torch_npu(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    probe = "import torch, importlib.util; print(importlib.util.find_spec('torch_npu').origin)"
    result = run_command([sys.executable, "-c", probe], env=env)
    assert result.returncode == 0, result.stderr
    assert str(tmp_path) in result.stdout


@pytest.mark.slow
def test_doctor_names_cann_when_torch_npu_cannot_load_libhccl(tmp_path):
    result = _doctor_subprocess(_stand_in_torch_npu(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    npu_line = next(line for line in result.stdout.splitlines() if line.startswith("torch-npu:"))
    assert "ERROR" in npu_line and LIBHCCL_ERROR in npu_line
    assert "cause: CANN environment not sourced" in result.stdout
    assert "set_env.sh" in result.stdout
    summary = result.stderr.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith("mcore-npu doctor: 1 error: torch-npu")
    assert "CANN environment not sourced" in summary[0]


@pytest.mark.slow
def test_installed_broken_torch_npu_breaks_import_torch_and_doctor_says_why(tmp_path):
    """A dist-info with the torch.backends entry point: torch's autoload fails at import."""
    root = _stand_in_torch_npu(tmp_path, distribution="2.6.0.post5")
    result = _doctor_subprocess(root, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    torch_check = checks["torch"]
    assert torch_check["status"] == "error"
    assert "Failed to load the backend extension: torch_npu" in torch_check["detail"]
    assert LIBHCCL_ERROR in torch_check["detail"]
    assert "CANN environment not sourced" in torch_check["cause"]
    assert "does not match torch-npu 2.6.0.post5" in torch_check["cause"]
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in torch_check["fix"]
    assert checks["torch-npu"]["status"] == "error"
    assert checks["attention"]["status"] == "warn"  # not checked, and doctor did not crash


@pytest.mark.slow
def test_autoload_switched_off_leaves_the_torch_npu_error(tmp_path):
    root = _stand_in_torch_npu(tmp_path, distribution="2.6.0.post5")
    result = _doctor_subprocess(root, "--json", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert result.returncode == 1
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["torch"]["status"] == "ok"
    assert checks["torch-npu"]["status"] == "error"
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0 is what keeps" in checks["torch-npu"]["fix"]


# --------------------------------------------------------------------------------------------
# the pieces
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "npu_version", "expected"),
    [
        (f"ImportError: {LIBHCCL_ERROR}", None, "CANN environment not sourced"),
        (
            "ImportError: libascendcl.so: cannot open shared object file. Please check that the "
            "runtime package is installed.",
            None,
            "CANN environment not sourced",
        ),
        ("OSError: libfoo.so: cannot open shared object file", None, "shared library"),
        (
            "RuntimeError: Two accelerators cannot be used at the same time in PyTorch: npu and "
            "cuda.",
            None,
            "CUDA build",
        ),
        ("ImportError: undefined symbol: _ZN3c10", None, "ABI mismatch"),
        ("ImportError: something else", "2.6.0.post5", "does not match torch-npu 2.6.0.post5"),
        ("ImportError: something else", "2.7.1", "not recognised"),
    ],
)
def test_diagnose_npu_error(error, npu_version, expected):
    cause, fix = doctor.diagnose_npu_error(error, "2.7.1+cpu", npu_version)
    assert expected in cause
    assert fix


def test_cannot_in_a_message_is_not_mistaken_for_cann():
    cause, _ = doctor.diagnose_npu_error("ImportError: cannot import name 'x'", "2.7.1", "2.7.1")
    assert "CANN" not in cause


@pytest.mark.parametrize(
    ("conf", "accelerator", "status"),
    [
        ("expandable_segments:True,max_split_size_mb:64", "npu", "error"),
        ("garbage_collection_threshold:0.6, expandable_segments:True", "npu", "error"),
        ("expandable_segments:True,max_split_size_mb:64", "cpu", "warn"),
        ("expandable_segments:False,max_split_size_mb:64", "npu", "ok"),
        ("expandable_segments:True,roundup_power2_divisions:[256:1,>:8]", "npu", "ok"),
    ],
)
def test_allocator_env_conflicts(clean_env, monkeypatch, conf, accelerator, status):
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", conf)
    check = doctor.check_allocator_env(doctor._Probe(accelerator=accelerator))
    assert check.status == status
    assert repr(conf) in check.detail
    if status != "ok":
        assert "refuses" in check.cause and "PYTORCH_NPU_ALLOC_CONF" in check.fix


def test_both_npu_and_generic_alloc_conf_is_a_warning(clean_env, monkeypatch):
    monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    check = doctor.check_allocator_env(doctor._Probe(accelerator="npu"))
    assert check.status == "warn" and "both" in check.cause


def test_a_check_that_raises_becomes_an_error_line(monkeypatch):
    def broken(probe):
        raise KeyError("weird environment")

    monkeypatch.setattr(doctor, "CHECKS", (("python", doctor.check_python), ("odd", broken)))
    checks = doctor.gather_checks()
    assert [c.status for c in checks] == ["ok", "error"]
    assert "KeyError" in checks[1].detail and "doctor could not check" in checks[1].detail


def test_text_format_marks_problems_and_aligns_values():
    checks = [
        doctor.Check("python", "ok", "3.11"),
        doctor.Check("torch-npu", "error", "does not import", "CANN not sourced", "source it"),
        doctor.Check("cann", "warn", "not sourced", "unset", "source it"),
    ]
    text = doctor.format_text(checks).splitlines()
    assert text[0] == "python:    3.11"
    assert text[1] == "torch-npu: ERROR does not import"
    assert text[2] == "           cause: CANN not sourced"
    assert text[3] == "           fix: source it"
    assert text[4] == "cann:      WARN not sourced"
    assert text[-1] == "summary:   1 error: torch-npu: CANN not sourced"
    assert doctor.summary(checks[:1] + checks[2:]) == "healthy (1 warning)"


@pytest.mark.parametrize("takes", [True, False])
def test_mla_value_line_reports_the_probed_path(monkeypatch, takes):
    """On an NPU the line reports what one probe call of the installed operator found (the
    probe itself runs against stand-ins in tests/transformer/test_mla.py); elsewhere the
    reference takes Dv < D unpadded."""
    import types

    from mcore_npu.ops import value_padding

    cpu = doctor.check_mla_value(doctor._probe_torch())
    assert cpu.status == doctor.OK and "unpadded" in cpu.detail and "reference" in cpu.detail
    stand_in = types.ModuleType("torch_npu")  # no NPU here: a stand-in module
    stand_in.npu_fusion_attention = lambda *args, **kwargs: None  # what the probe would call
    monkeypatch.setitem(sys.modules, "torch_npu", stand_in)
    asked = []
    monkeypatch.setattr(value_padding, "_probe", lambda module, dev: asked.append(dev) or takes)
    probe = doctor._Probe(torch=doctor._probe_torch().torch, accelerator="npu")
    check = doctor.check_mla_value(probe)
    assert asked == ["npu"]
    if takes:
        assert check.status == doctor.OK and check.detail.startswith("Dv < D unpadded")
    else:
        assert check.status == doctor.WARN and check.detail.startswith("Dv < D padded")
        assert "CANN" in check.fix
