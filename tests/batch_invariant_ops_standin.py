"""A stand-in for vllm-ascend's AscendC ``batch_invariant_ops`` library (no NPU here): importing
it gives ``torch.ops.batch_invariant_ops.npu_matmul_batch_invariant(self, other)`` and
``npu_reduce_sum_batch_invariant(self, dim, keepdim)`` with the schemas vllm-ascend calls, for
CPU tensors, recording every call and answering with the plugin's fixed-block references."""

from __future__ import annotations

import sys
import types

import torch

from mcore_npu.ops.batch_invariant_rows import LIBRARY, fixed_block_linear, fixed_block_sum

_LIBRARY = None  # torch.library namespaces live for the process: defined once


class BatchInvariantOps(types.ModuleType):
    def __init__(self) -> None:
        super().__init__(LIBRARY)
        self.calls: list[tuple[str, tuple]] = []


def _record(name: str, *args) -> None:
    sys.modules[LIBRARY].calls.append((name, args))


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _record("npu_matmul_batch_invariant", a, b)
    return fixed_block_linear(a, b.t())


def _reduce_sum(x: torch.Tensor, dim: int, keepdim: bool) -> torch.Tensor:
    _record("npu_reduce_sum_batch_invariant", x, dim, keepdim)
    return fixed_block_sum(x, dim, keepdim)


def define() -> None:
    """The library's ``torch.ops`` namespace with its two operators (once per process)."""
    global _LIBRARY
    if _LIBRARY is not None:
        return
    _LIBRARY = torch.library.Library(LIBRARY, "DEF")
    _LIBRARY.define("npu_matmul_batch_invariant(Tensor self, Tensor other) -> Tensor")
    _LIBRARY.define("npu_reduce_sum_batch_invariant(Tensor self, int dim, bool keepdim) -> Tensor")
    _LIBRARY.impl("npu_matmul_batch_invariant", _matmul, "CPU")
    _LIBRARY.impl("npu_reduce_sum_batch_invariant", _reduce_sum, "CPU")


def install(monkeypatch) -> BatchInvariantOps:
    """The stand-in as ``sys.modules["batch_invariant_ops"]`` for the test."""
    define()
    standin = BatchInvariantOps()
    monkeypatch.setitem(sys.modules, LIBRARY, standin)
    return standin
