"""Stand-ins for the NPU and CUDA allocator APIs, installed with ``monkeypatch``.

No hardware and no torch_npu are needed: a fake ``torch.npu`` namespace replaces torch_npu's
module, and the CUDA setters are replaced by recorders with ``torch.cuda.is_available`` patched
to return True. Every installer also hides any real torch_npu from detection, so the tests
behave the same on a machine where torch_npu is installed.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import pytest
import torch

from mcore_npu.allocator import device

ALLOC_CONF_VARS = ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass
class FakeNpu:
    """A fake ``torch.npu``: ``is_available``, ``is_initialized``, ``memory._set_allocator_settings``.

    Attributes:
        calls: every string passed to the allocator setter, in order.
        available: what ``is_available()`` returns.
        available_error: raised by ``is_available()`` instead, when set.
        initialized: what ``is_initialized()`` returns (the "allocator initialised" switch).
        setter_error: raised by the setter (after recording the call), when set.
    """

    has_setter: bool = True
    available: bool = True
    available_error: Exception | None = None
    initialized: bool = False
    setter_error: Exception | None = None
    calls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.memory = types.SimpleNamespace()
        if self.has_setter:
            self.memory._set_allocator_settings = self._set_allocator_settings

    def is_available(self) -> bool:
        if self.available_error is not None:
            raise self.available_error
        return self.available

    def is_initialized(self) -> bool:
        return self.initialized

    def current_device(self) -> int:
        return 0

    def _set_allocator_settings(self, settings: str) -> None:
        self.calls.append(settings)
        if self.setter_error is not None:
            raise self.setter_error


@dataclass
class CudaRecorder:
    """Records calls to the generic and the CUDA-specific allocator setters."""

    generic_calls: list[str] = field(default_factory=list)
    cuda_calls: list[str] = field(default_factory=list)

    def generic(self, settings: str) -> None:
        self.generic_calls.append(settings)

    def cuda(self, settings: str) -> None:
        self.cuda_calls.append(settings)

    @property
    def all_calls(self) -> list[str]:
        return self.generic_calls + self.cuda_calls


def reset_device_state() -> None:
    """Forget last-set values, emitted warnings and import errors recorded by mcore_npu.allocator.device."""
    device._STATE.reset()


def clear_alloc_conf_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset the allocator variables; monkeypatch restores them, even if the code wrote them."""
    for var in ALLOC_CONF_VARS:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)


def _hide_real_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "_torch_npu_installed", lambda: False)


def install_fake_npu(monkeypatch: pytest.MonkeyPatch, **options: object) -> FakeNpu:
    """Make this process look like an NPU machine; ``options`` go to :class:`FakeNpu`."""
    _hide_real_torch_npu(monkeypatch)
    fake = FakeNpu(**options)  # type: ignore[arg-type]
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return fake


def install_fake_cuda(
    monkeypatch: pytest.MonkeyPatch, *, generic_setter: bool = True
) -> CudaRecorder:
    """Make this process look like a CUDA machine whose setters record their calls.

    With ``generic_setter=False`` the torch build looks like one without
    ``torch._C._accelerator_setAllocatorSettings``.
    """
    _hide_real_torch_npu(monkeypatch)
    recorder = CudaRecorder()
    monkeypatch.setattr(torch, "npu", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", recorder.cuda)
    if generic_setter:
        monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", recorder.generic)
    else:
        monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
    return recorder


def install_cpu_only(monkeypatch: pytest.MonkeyPatch) -> CudaRecorder:
    """No NPU, no CUDA; the CUDA setters still record, to prove nothing calls them."""
    recorder = install_fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return recorder


@pytest.fixture
def clean_allocator_state(monkeypatch: pytest.MonkeyPatch):
    """No allocator variables and a fresh mcore_npu.allocator.device state, before and after each test."""
    reset_device_state()
    clear_alloc_conf_env(monkeypatch)
    yield
    reset_device_state()
