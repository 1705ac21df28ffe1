"""Tests for ``mcore_npu.allocator.device``: detection and the expandable-segments switch.

No hardware is used: the NPU and CUDA allocator APIs are stand-ins from
``tests/allocator_standins.py``, installed with ``monkeypatch`` (a fake ``torch.npu`` namespace,
recording setters, an "allocator initialised" switch). Allocator environment variables are set
and removed through ``monkeypatch`` so no test leaks them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mcore_npu.allocator import device
from mcore_npu.allocator.device import (
    ExpandableSegmentsWarning,
    current_accelerator,
    current_device,
    expandable_segments,
    is_npu_available,
    npu_import_error,
    set_expandable_segments,
)
from tests.allocator.standins import (
    clean_allocator_state,  # noqa: F401  (a fixture, used through pytestmark)
    install_cpu_only,
    install_fake_cuda,
    install_fake_npu,
)
from tests.launch import ROOT, run_command

NPU_CONF = "PYTORCH_NPU_ALLOC_CONF"


pytestmark = pytest.mark.usefixtures("clean_allocator_state")


def _ours(recwarn: pytest.WarningsRecorder) -> list[str]:
    return [str(w.message) for w in recwarn if issubclass(w.category, ExpandableSegmentsWarning)]


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *env.values()])}
    return run_command(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=child_env,
    )


# ---------------------------------------------------------------------------------------------
# detection
# ---------------------------------------------------------------------------------------------


def test_current_accelerator_is_decided_at_call_time(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    assert current_accelerator() == "npu"
    assert is_npu_available()
    fake.available = False
    assert current_accelerator() == "cpu"
    assert not is_npu_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert current_accelerator() == "cuda"
    fake.available = True
    assert current_accelerator() == "npu"


@pytest.mark.parametrize("error", [RuntimeError("driver gone"), OSError("libascendcl.so")])
def test_detection_never_raises(monkeypatch, error):
    install_fake_npu(monkeypatch, available_error=error)
    assert is_npu_available() is False
    assert current_accelerator() == "cpu"


def test_detection_survives_cuda_query_raising(monkeypatch):
    install_cpu_only(monkeypatch)

    def broken() -> bool:
        raise RuntimeError("CUDA driver initialisation failed")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert current_accelerator() == "cpu"


def test_current_device(monkeypatch):
    install_cpu_only(monkeypatch)
    assert current_device() == torch.device("cpu")
    install_fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert current_device() == torch.device("cuda", 3)


def _fake_torch_npu_package(root: Path, body: str) -> Path:
    package = root / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(body))
    return root


@pytest.fixture
def forget_torch_npu(monkeypatch):
    """Make ``torch.npu`` and ``torch_npu`` absent for the test (a real one comes back after)."""
    monkeypatch.setattr(torch, "npu", None, raising=False)
    if "torch_npu" in sys.modules:
        monkeypatch.delitem(sys.modules, "torch_npu")
    yield
    sys.modules.pop("torch_npu", None)  # the fake imported by the test; monkeypatch runs later


def test_installed_but_broken_torch_npu_means_cpu(monkeypatch, tmp_path, forget_torch_npu):
    body = """
        raise ImportError("libhccl.so: cannot open shared object file. Please check that the "
                          "cann package is installed.")
    """
    monkeypatch.syspath_prepend(str(_fake_torch_npu_package(tmp_path, body)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert current_accelerator() == "cpu"
    assert "ImportError: libhccl.so" in (npu_import_error() or "")


def test_installed_torch_npu_is_imported_at_call_time(monkeypatch, tmp_path, forget_torch_npu):
    body = """
        import types
        import torch
        torch.npu = types.SimpleNamespace(is_available=lambda: True)
    """
    monkeypatch.syspath_prepend(str(_fake_torch_npu_package(tmp_path, body)))
    assert "torch_npu" not in sys.modules
    assert current_accelerator() == "npu"
    assert "torch_npu" in sys.modules
    assert npu_import_error() is None


def test_importing_device_module_does_not_import_torch_npu(tmp_path):
    # A torch_npu on the path that would be imported by eager detection.
    root = _fake_torch_npu_package(tmp_path, "import torch\n")
    result = _run_python(
        """
        import importlib.util, sys
        assert importlib.util.find_spec("torch_npu") is not None, "fake torch_npu not visible"
        import mcore_npu
        import mcore_npu.allocator.device
        import mcore_npu.allocator.workers
        print("torch_npu" in sys.modules, "torch" in sys.modules)
        """,
        fake=str(root),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


# ---------------------------------------------------------------------------------------------
# NPU with the runtime setter
# ---------------------------------------------------------------------------------------------


def test_npu_runtime_setter(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    assert set_expandable_segments(True) is True
    assert set_expandable_segments(False) is True
    assert fake.calls == ["expandable_segments:True", "expandable_segments:False"]
    assert NPU_CONF not in os.environ  # the runtime setter never touches the env var


def test_npu_runtime_setter_failure_warns_once_or_raises(monkeypatch, recwarn):
    fake = install_fake_npu(monkeypatch, setter_error=RuntimeError("aclrtReserveMemAddress"))
    assert set_expandable_segments(True) is False
    assert set_expandable_segments(True) is False
    assert len(fake.calls) == 2
    assert len(_ours(recwarn)) == 1
    with pytest.raises(RuntimeError, match="aclrtReserveMemAddress") as info:
        set_expandable_segments(True, strict=True)
    assert "Fix:" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


# ---------------------------------------------------------------------------------------------
# NPU without the runtime setter (torch-npu before 7.3.0)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "enable", "after"),
    [
        (None, True, "expandable_segments:True"),
        ("", True, "expandable_segments:True"),
        ("segment_size_mb:40", True, "segment_size_mb:40,expandable_segments:True"),
        ("max_split_size_mb:1024", False, "max_split_size_mb:1024,expandable_segments:False"),
        (
            "garbage_collection_threshold:0.8, max_split_size_mb:64",
            False,
            "garbage_collection_threshold:0.8,max_split_size_mb:64,expandable_segments:False",
        ),
        (
            "expandable_segments:False,segment_size_mb:40",
            True,
            "expandable_segments:True,segment_size_mb:40",
        ),
        (
            "expandable_segments:True,page_size:1g,expandable_segments:True",
            False,
            "expandable_segments:False,page_size:1g",
        ),
        (
            "roundup_power2_divisions:[256:1,512:2,>:8],base_addr_aligned_kb:4",
            True,
            "roundup_power2_divisions:[256:1,512:2,>:8],base_addr_aligned_kb:4,"
            "expandable_segments:True",
        ),
    ],
)
def test_old_torch_npu_merges_env_before_init(monkeypatch, recwarn, before, enable, after):
    fake = install_fake_npu(monkeypatch, has_setter=False, initialized=False)
    if before is not None:
        monkeypatch.setenv(NPU_CONF, before)
    assert set_expandable_segments(enable) is True
    assert os.environ[NPU_CONF] == after
    assert fake.calls == []
    assert _ours(recwarn) == []


def test_old_torch_npu_env_is_inherited_by_children(monkeypatch):
    install_fake_npu(monkeypatch, has_setter=False, initialized=False)
    monkeypatch.setenv(NPU_CONF, "max_split_size_mb:512")
    assert set_expandable_segments(False) is True
    result = _run_python("import os; print(os.environ['PYTORCH_NPU_ALLOC_CONF'])")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "max_split_size_mb:512,expandable_segments:False"


def test_old_torch_npu_refuses_to_enable_next_to_conflicting_options(monkeypatch, recwarn):
    install_fake_npu(monkeypatch, has_setter=False, initialized=False)
    monkeypatch.setenv(NPU_CONF, "max_split_size_mb:1024")
    assert set_expandable_segments(True) is False
    assert os.environ[NPU_CONF] == "max_split_size_mb:1024"
    (message,) = _ours(recwarn)
    assert "max_split_size_mb" in message
    with pytest.raises(RuntimeError, match="max_split_size_mb"):
        set_expandable_segments(True, strict=True)


def test_old_torch_npu_after_init_warns_once_and_strict_raises(monkeypatch, recwarn):
    install_fake_npu(monkeypatch, has_setter=False, initialized=True)
    assert set_expandable_segments(True) is False
    assert set_expandable_segments(True) is False
    assert NPU_CONF not in os.environ
    (message,) = _ours(recwarn)
    assert "2.6.0.post5" in message
    assert "2.9.0" in message
    with pytest.raises(RuntimeError, match="torch-npu") as info:
        set_expandable_segments(True, strict=True)
    assert "Fix:" in str(info.value)


def test_old_torch_npu_after_init_already_at_requested_value(monkeypatch, recwarn):
    install_fake_npu(monkeypatch, has_setter=False, initialized=True)
    assert set_expandable_segments(False) is True  # the default the allocator read
    monkeypatch.setenv(NPU_CONF, "expandable_segments:True")
    assert set_expandable_segments(True) is True
    assert _ours(recwarn) == []


def test_old_torch_npu_without_init_probe_assumes_initialised(monkeypatch, recwarn):
    fake = install_fake_npu(monkeypatch, has_setter=False)
    monkeypatch.delattr(type(fake), "is_initialized")
    assert set_expandable_segments(True) is False
    assert NPU_CONF not in os.environ
    assert len(_ours(recwarn)) == 1


# ---------------------------------------------------------------------------------------------
# CUDA and CPU
# ---------------------------------------------------------------------------------------------


def test_cuda_uses_generic_setter_when_present(monkeypatch):
    recorder = install_fake_cuda(monkeypatch, generic_setter=True)
    assert set_expandable_segments(True) is True
    assert recorder.generic_calls == ["expandable_segments:True"]
    assert recorder.cuda_calls == []


def test_cuda_falls_back_to_cuda_setter(monkeypatch):
    recorder = install_fake_cuda(monkeypatch, generic_setter=False)
    assert set_expandable_segments(False) is True
    assert recorder.generic_calls == []
    assert recorder.cuda_calls == ["expandable_segments:False"]


def test_cuda_without_any_setter(monkeypatch, recwarn):
    install_fake_cuda(monkeypatch, generic_setter=False)
    monkeypatch.delattr(torch.cuda.memory, "_set_allocator_settings")
    assert set_expandable_segments(True) is False
    assert len(_ours(recwarn)) == 1
    with pytest.raises(RuntimeError, match="PYTORCH_CUDA_ALLOC_CONF"):
        set_expandable_segments(True, strict=True)


def test_cpu_returns_false_and_calls_nothing(monkeypatch, recwarn, caplog):
    recorder = install_cpu_only(monkeypatch)
    caplog.set_level("DEBUG", logger="mcore_npu.allocator.device")
    assert set_expandable_segments(True) is False
    assert set_expandable_segments(True, strict=True) is False
    assert recorder.all_calls == []
    assert _ours(recwarn) == []
    assert any("nothing to configure" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# conflicts and argument checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accelerator", "var"),
    [
        ("npu", "PYTORCH_NPU_ALLOC_CONF"),
        ("cuda", "PYTORCH_CUDA_ALLOC_CONF"),
        ("cuda", "PYTORCH_ALLOC_CONF"),
    ],
)
@pytest.mark.parametrize("option", ["max_split_size_mb:256", "garbage_collection_threshold:0.6"])
def test_conflicting_options_warn_once(monkeypatch, recwarn, accelerator, var, option):
    if accelerator == "npu":
        install_fake_npu(monkeypatch)
    else:
        install_fake_cuda(monkeypatch)
    monkeypatch.setenv(var, option)
    assert set_expandable_segments(True) is True
    assert set_expandable_segments(False) is True
    assert set_expandable_segments(True) is True
    (message,) = _ours(recwarn)
    key = option.split(":")[0]
    assert var in message
    assert key in message
    assert "cannot be combined with expandable segments" in message
    assert "resets these options to their defaults" in message


def test_non_conflicting_options_get_a_reset_warning_only(monkeypatch, recwarn):
    install_fake_npu(monkeypatch)
    monkeypatch.setenv(NPU_CONF, "roundup_power2_divisions:[256:1,>:8]")
    assert set_expandable_segments(True) is True
    (message,) = _ours(recwarn)
    assert "roundup_power2_divisions" in message
    assert "resets these options to their defaults" in message
    assert "cannot be combined" not in message


def test_no_warning_for_a_clean_configuration(monkeypatch, recwarn):
    install_fake_npu(monkeypatch)
    monkeypatch.setenv(NPU_CONF, "expandable_segments:False")
    assert set_expandable_segments(True) is True
    assert _ours(recwarn) == []


@pytest.mark.parametrize(
    ("call", "name", "value"),
    [
        (lambda: set_expandable_segments("yes"), "enable", "'yes'"),
        (lambda: set_expandable_segments(1), "enable", "1"),
        (lambda: set_expandable_segments(None), "enable", "None"),
        (lambda: set_expandable_segments(True, strict="no"), "strict", "'no'"),
        (lambda: expandable_segments("off").__enter__(), "enable", "'off'"),
    ],
)
def test_bad_argument_types(monkeypatch, call, name, value):
    fake = install_fake_npu(monkeypatch)
    with pytest.raises(TypeError) as info:
        call()
    message = str(info.value)
    assert name in message
    assert value in message
    assert f"{name}=True" in message
    assert fake.calls == []


# ---------------------------------------------------------------------------------------------
# the context manager
# ---------------------------------------------------------------------------------------------


def test_context_manager_restores_on_normal_exit(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    set_expandable_segments(True)
    with expandable_segments(False) as in_effect:
        assert in_effect is True
        assert fake.calls[-1] == "expandable_segments:False"
    assert fake.calls == [
        "expandable_segments:True",
        "expandable_segments:False",
        "expandable_segments:True",
    ]


def test_context_manager_restores_on_exception(monkeypatch):
    recorder = install_fake_cuda(monkeypatch)
    set_expandable_segments(True)
    with pytest.raises(ValueError, match="weight sync failed"), expandable_segments(False):
        raise ValueError("weight sync failed")
    assert recorder.generic_calls[-1] == "expandable_segments:True"
    assert len(recorder.generic_calls) == 3


def test_context_manager_restore_failure_does_not_hide_the_error(monkeypatch, recwarn):
    fake = install_fake_npu(monkeypatch)
    set_expandable_segments(True)
    with pytest.raises(ValueError, match="original"), expandable_segments(False, strict=True):
        fake.setter_error = RuntimeError("device lost")
        raise ValueError("original")
    assert fake.calls[-1] == "expandable_segments:True"
    assert len(_ours(recwarn)) == 1


def test_context_manager_previous_value_from_env(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    monkeypatch.setenv(NPU_CONF, "expandable_segments:True")
    with expandable_segments(False):
        pass
    assert fake.calls == ["expandable_segments:False", "expandable_segments:True"]


def test_context_manager_skips_restore_when_nothing_changes(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    with expandable_segments(False):  # allocator default is False
        pass
    assert fake.calls == ["expandable_segments:False"]


def test_context_manager_on_cpu(monkeypatch):
    recorder = install_cpu_only(monkeypatch)
    with expandable_segments(False) as in_effect:
        assert in_effect is False
    assert recorder.all_calls == []


# ---------------------------------------------------------------------------------------------
# configuration strings
# ---------------------------------------------------------------------------------------------


def test_parse_conf_keeps_bracketed_values():
    parsed = device.parse_alloc_conf("max_split_size_mb:64, roundup_power2_divisions:[256:1,>:8]")
    assert parsed == {"max_split_size_mb": "64", "roundup_power2_divisions": "[256:1,>:8]"}


# ---------------------------------------------------------------------------------------------
# benchmarks/cuda_expandable_segments.py, driven by a simulated CUDA allocator
# ---------------------------------------------------------------------------------------------


def _load_cuda_benchmark():
    path = ROOT / "benchmarks" / "cuda_expandable_segments.py"
    spec = importlib.util.spec_from_file_location("cuda_expandable_segments", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _simulate_cuda_allocator(monkeypatch, recorder, *, honour_setting: bool) -> None:
    """CPU tensors stand in for CUDA ones; each allocation gets a segment of its own whose
    ``is_expandable`` follows the last setting (or is always True if not ``honour_setting``)."""
    segments: list[dict] = []
    real_empty = torch.empty

    def empty(nbytes, *, dtype, device):
        assert device == "cuda"
        tensor = real_empty(nbytes, dtype=dtype)
        calls = recorder.all_calls
        expandable = calls[-1] == "expandable_segments:True" if honour_setting else True
        address = tensor.data_ptr()
        segments.append({"address": address, "total_size": nbytes, "is_expandable": expandable})
        return tensor

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: list(segments))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "simulated")


@pytest.mark.parametrize(("honour_setting", "exit_code"), [(True, 0), (False, 1)])
def test_cuda_benchmark_logic(monkeypatch, capsys, honour_setting, exit_code):
    benchmark = _load_cuda_benchmark()
    recorder = install_fake_cuda(monkeypatch)
    _simulate_cuda_allocator(monkeypatch, recorder, honour_setting=honour_setting)
    assert benchmark.main(["--mib", "1"]) == exit_code
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is (exit_code == 0)
    assert [p["is_expandable"] for p in result["phases"]] == (
        [True, False, True] if honour_setting else [True, True, True]
    )
    assert recorder.generic_calls == [
        "expandable_segments:True",
        "expandable_segments:False",
        "expandable_segments:True",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path needs a machine without")
def test_cuda_benchmark_without_cuda_exits_with_a_message():
    path = ROOT / "benchmarks" / "cuda_expandable_segments.py"
    result = run_command([sys.executable, str(path)])
    assert result.returncode == 2, result.stderr
    assert "no CUDA device" in result.stderr
    assert json.loads(result.stdout)["ok"] is None
