"""A stand-in for torch_npu's ``torch.npu`` module (we have no NPU): the calls the demo trainer's
table (``mcore_npu.training.npu_calls``) makes, answered by the CPU and counted by name.

``is_available()`` is False, so the process still takes the CPU's accelerator choice (gloo, the
CPU devices) while the table sends Megatron's CUDA calls here. Install it with ``install()``.
"""

from __future__ import annotations

import collections
import contextlib
import types

import torch

from mcore_npu.cpu.shims import CpuStream


class CpuBackedNpu(types.ModuleType):
    """``torch.npu`` with the attributes the table calls (real torch_npu has each of them)."""

    def __init__(self) -> None:
        super().__init__("torch.npu")
        self.calls: collections.Counter = collections.Counter()

    def is_available(self) -> bool:
        return False

    def synchronize(self, device=None) -> None:
        self.calls["synchronize"] += 1

    def Stream(self, device=None, priority: int = 0) -> CpuStream:
        self.calls["Stream"] += 1
        return CpuStream()

    def current_stream(self, device=None) -> CpuStream:
        self.calls["current_stream"] += 1
        return CpuStream()

    def stream(self, stream=None):
        self.calls["stream"] += 1
        return contextlib.nullcontext()

    def set_device(self, device) -> None:
        self.calls["set_device"] += 1

    def get_rng_state(self) -> torch.Tensor:
        self.calls["get_rng_state"] += 1
        return torch.get_rng_state()

    def set_rng_state(self, state) -> None:
        self.calls["set_rng_state"] += 1
        torch.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        self.calls["manual_seed"] += 1
        torch.manual_seed(seed)


def install() -> CpuBackedNpu:
    """Set ``torch.npu`` to a fresh stand-in (as importing torch_npu does) and return it."""
    module = CpuBackedNpu()
    torch.npu = module
    return module
