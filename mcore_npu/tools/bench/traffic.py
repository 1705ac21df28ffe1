"""Count what a block of code sends to other ranks and where it would stall the host.

``count_traffic(group_size)`` watches every operator the block dispatches (a
``TorchDispatchMode``: the ``c10d`` collectives too, forward and backward) and every tensor
method it calls from Python (a ``TorchFunctionMode``); it changes, wraps and allocates nothing.
Bytes sent per rank are charged per collective as its standard algorithm sends them (the
bus-bytes convention of the NCCL/HCCL tests: :func:`collective_bytes`). Host synchronisations
are the calls that make an accelerator wait for the host: :data:`SYNC_OPS`, a boolean index,
``repeat_interleave`` without ``output_size``, :data:`SYNC_METHODS` and ``to`` a CPU device.
A collective's ``wait()`` is not counted (on an NPU it orders streams). Tables: docs/bench.md.
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = (  # need the device's data on the host (matched on the overload packet)
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique",
    "aten._unique2",
    "aten.unique_dim",
    "aten.unique_consecutive",
    "aten.bincount",
    "aten.equal",
    "aten.is_nonzero",
)
BOOL_INDEX_OPS = ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_")
SYNC_METHODS = ("tolist", "numpy", "cpu")  # copy to the host (``to`` a CPU device: separately)


@dataclass
class Traffic:
    """What one block did: ``bytes_sent`` per rank, ``calls`` per collective, ``syncs`` per op."""

    bytes_sent: int = 0
    calls: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    sync_sites: Counter = field(default_factory=Counter)

    def add_sync(self, name: str) -> None:
        self.syncs[name] += 1
        self.sync_sites[_project_site()] += 1

    def as_dict(self) -> dict:
        counts = {"calls": dict(self.calls), "syncs": dict(self.syncs)}
        syncs = {"sync_count": sum(self.syncs.values()), "sync_sites": dict(self.sync_sites)}
        return {"bytes_sent": self.bytes_sent, **counts, **syncs}


_NOT_SITES = ("/mcore_npu/cpu/shims.py",) + tuple(
    f"/mcore_npu/tools/bench/{name}.py" for name in ("traffic", "cp", "cp_worker")
)


def _project_site() -> str:
    """``path:line`` of the innermost ``mcore_npu`` frame that made the call (not this tool's,
    nor the CPU shims' ``TorchFunctionMode``, which sits on the stack of every call)."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/mcore_npu/" in path and not path.endswith(_NOT_SITES):
            return f"mcore_npu/{path.rsplit('/mcore_npu/', 1)[1]}:{frame.lineno}"
    return "outside mcore_npu"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _listed_bytes(tensors) -> int:
    return sum(_nbytes(t) for t in tensors)


def collective_bytes(name: str, args, group_size: int) -> int | None:
    """Bytes this rank sends in the ``c10d`` op ``name`` (None: an op this table lacks)."""
    p = group_size
    if name == "c10d.allgather_":  # (outputs [[...]], inputs [...], pg, ...)
        return (p - 1) * _listed_bytes(args[1])
    if name == "c10d._allgather_base_":  # (output, input, pg, ...)
        return (p - 1) * _nbytes(args[1])
    if name == "c10d.allreduce_":  # (tensors [...], pg, op, ...)
        return 2 * (p - 1) * _listed_bytes(args[0]) // p
    if name == "c10d._reduce_scatter_base_":  # (output, input, pg, ...)
        return (p - 1) * _nbytes(args[1]) // p
    if name == "c10d.reduce_scatter_":  # (outputs [...], inputs [[...]], pg, ...)
        return (p - 1) * sum(_listed_bytes(row) for row in args[1]) // p
    if name == "c10d.alltoall_base_":  # (output, input, pg, out_splits, in_splits, ...)
        if args[3] or args[4]:
            return None  # uneven splits: not in the table
        return (p - 1) * _nbytes(args[1]) // p
    if name == "c10d.send":  # (tensors [...], dst, ...)
        return _listed_bytes(args[0])
    if name in ("c10d.recv_", "c10d.recv_any_source_", "c10d.barrier"):
        return 0
    return None


def _synchronises(name: str, args, kwargs) -> bool:
    """Whether the operator ``name`` needs device data on the host."""
    if name in SYNC_OPS:
        return True
    if name in BOOL_INDEX_OPS:
        return _bool_index(args)
    if name == "aten.repeat_interleave":  # repeats given as a tensor, no output_size
        return isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None
    return False


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class _OperatorCounter(TorchDispatchMode):
    def __init__(self, traffic: Traffic, group_size: int):
        super().__init__()
        self.traffic, self.group_size = traffic, group_size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("c10d."):
            sent = collective_bytes(name, args, self.group_size)
            if sent is None:
                self.traffic.calls[f"unknown:{name}"] += 1
            else:
                self.traffic.calls[name] += 1
                self.traffic.bytes_sent += sent
        elif _synchronises(name, args, kwargs or {}):
            self.traffic.add_sync(name)
        return func(*args, **(kwargs or {}))


class _MethodCounter(TorchFunctionMode):
    def __init__(self, traffic: Traffic):
        super().__init__()
        self.traffic = traffic

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS or (name == "to" and _to_cpu(args, kwargs or {})):
            self.traffic.add_sync(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


def _to_cpu(args, kwargs) -> bool:
    targets = [*args[1:], kwargs.get("device")]
    return any(
        (isinstance(t, str) and t.startswith("cpu"))
        or (isinstance(t, torch.device) and t.type == "cpu")
        for t in targets
    )


@contextlib.contextmanager
def count_traffic(group_size: int):
    """Context manager yielding a ``Traffic`` that fills in while the block runs;
    ``group_size``: P of the collectives' groups (every collective of the block is on it)."""
    traffic = Traffic()
    with _MethodCounter(traffic), _OperatorCounter(traffic, group_size):
        yield traffic
