"""Megatron-Core's CUDA calls on an Ascend NPU, for the demo trainer: one table, :data:`PATCHES`,
in place of torch_npu's wholesale ``transfer_to_npu``.

Without ``transfer_to_npu``, ``torch.cuda`` on an NPU machine is the CUDA-less ``torch.cuda`` of
a CPU: each entry the CPU runtime replaces because CUDA is absent is replaced here by its
``torch.npu`` counterpart; those it replaces for gloo or for verl are not (:data:`NOT_ON_NPU`).
``apply(device)`` installs the table and enters :data:`FUNCTION_MODE` on ``device``;
``revert()`` gives every original object back. The list: docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mcore_npu import cpu as cpu_runtime
from mcore_npu.cpu import shims
from mcore_npu.cpu.patches import PATCHES as CPU_PATCHES
from mcore_npu.cpu.patches import Patch, install, restore

__all__ = ["FUNCTION_MODE", "NOT_ON_NPU", "PATCHES", "applied", "apply", "revert"]


# One function per replaced torch.cuda entry point (torch's dynamo keeps a rule per object).


def trainer_device() -> torch.device:
    """``torch.cuda.current_device``: the device ``apply`` was given, the trainer's NPU
    (Megatron passes it on as ``device=``)."""
    return _STATE.device


def npu_synchronize(device=None) -> None:
    """``torch.cuda.synchronize``."""
    torch.npu.synchronize(_on_npu(device))


def new_npu_stream(device=None, priority: int = 0, **kwargs):
    """``torch.cuda.Stream(...)``: a new stream on the trainer's NPU (Megatron makes streams
    on the current device; ``device="cuda"`` means it)."""
    return torch.npu.Stream(device=_STATE.device, priority=priority, **kwargs)


def npu_current_stream(device=None):
    """``torch.cuda.current_stream``."""
    return torch.npu.current_stream(_on_npu(device))


def npu_stream(stream=None):
    """``torch.cuda.stream(s)``: the NPU stream context."""
    return torch.npu.stream(stream)


def npu_set_device(device) -> None:
    """``torch.cuda.set_device``."""
    torch.npu.set_device(_on_npu(device))


def _on_npu(device):
    """A device argument written for CUDA (``"cuda"``, ``"cuda:N"``), for ``torch.npu``."""
    return _STATE.mode.redirect(device) if shims.is_cuda_device(device) else device


def make_npu_rng_tracker():
    """Megatron's RNG tracker whose named streams are states of the current NPU's generator."""
    return shims.rng_tracker_on(torch.npu)


def get_npu_rng_state(*args, **kwargs) -> torch.Tensor:
    """Megatron's ``_get_cuda_rng_state``: the current NPU generator's state."""
    return torch.npu.get_rng_state()


def set_npu_rng_state(state, *args, **kwargs) -> None:
    """Megatron's ``_set_cuda_rng_state``."""
    torch.npu.set_rng_state(state)


def splits_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Megatron's ``maybe_move_tensor_to_cpu``, which moves only ``is_cuda`` tensors: an NPU
    tensor goes to the host too (as numbers where ``as_numpy``: the alltoall dispatcher's split
    sizes); a host tensor as the CPU runtime's rule says."""
    if not torch.is_tensor(tensor) or tensor.device.type == "cpu":
        return shims.splits_to_host(tensor, as_numpy)
    host = tensor.to("cpu", non_blocking=True)
    if record_stream:
        tensor.record_stream(torch.npu.current_stream())
    return host.numpy() if as_numpy else host


def _cuda(name: str, replacement, reason: str) -> Patch:
    return Patch("torch.cuda", name, replacement, "value", reason)


def _as_in_the_cpu_runtime(attribute: str) -> Patch:
    """The CPU runtime's entry for ``attribute``: device-neutral, the same on an NPU."""
    (patch,) = [patch for patch in CPU_PATCHES if patch.attribute == attribute]
    return patch


_RANDOM = "megatron.core.tensor_parallel.random"

PATCHES: tuple[Patch, ...] = (
    _cuda("current_device", trainer_device, "Megatron allocates on current_device()"),
    _cuda("synchronize", npu_synchronize, "p2p and checkpoint saving synchronise"),
    _cuda("Stream", new_npu_stream, "the MoE alltoall dispatcher's side stream"),
    _cuda("current_stream", npu_current_stream, "the same dispatcher's default stream"),
    _cuda("stream", npu_stream, "the same dispatcher's stream context"),
    _cuda("set_device", npu_set_device, "DeviceMesh('cuda') selects the device"),
    Patch(_RANDOM, "_CUDA_RNG_STATE_TRACKER", make_npu_rng_tracker, "new",
          "Megatron's named RNG streams (dropout, init) as NPU generator states"),
    _as_in_the_cpu_runtime("_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
    Patch(_RANDOM, "_get_cuda_rng_state", get_npu_rng_state, "value",
          "full recompute saves the RNG state"),
    Patch(_RANDOM, "_set_cuda_rng_state", set_npu_rng_state, "value",
          "full recompute restores the RNG state"),
    _as_in_the_cpu_runtime("clip_grad_by_total_norm_fp32"),
    Patch("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
          splits_to_host, "value",
          "it moves only is_cuda tensors; the alltoall dispatcher's split sizes must reach "
          "all_to_all_single as numbers"),
    _as_in_the_cpu_runtime("DistributedOptimizer.__init__"),
    _as_in_the_cpu_runtime("Float16OptimizerWithFloat16Params.__init__"),
)  # fmt: skip

NOT_ON_NPU: dict[tuple[str, str], str] = {
    ("torch.cuda", "mem_get_info"): "verl's; verl asks torch.npu on an NPU",
    ("torch.cuda", "get_device_name"): "verl's; verl asks torch.npu on an NPU",
    ("torch.cuda", "ipc_collect"): "verl's; verl asks torch.npu on an NPU",
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"):
        "gloo's: on an NPU hccl's all_gather takes the unequal rows (not run here)",
}  # fmt: skip
"""Entries of the CPU runtime's table this one leaves alone, with the reason."""

FUNCTION_MODE = (
    shims.CudaFactoriesOn,
    "device='cuda' in torch factory calls, Tensor.to('cuda') and Tensor.cuda() -> the NPU",
)


@dataclass
class _State:
    originals: list = field(default_factory=list)
    mode: object = None
    device: torch.device | None = None


_STATE = _State()


def applied() -> bool:
    """Whether ``apply()`` is in effect in this process."""
    return _STATE.mode is not None


def apply(device: torch.device) -> None:
    """Install :data:`PATCHES` and enter :data:`FUNCTION_MODE` on ``device`` (the trainer's NPU;
    idempotent; ``RuntimeError`` while the CPU runtime is applied)."""
    if applied():
        return
    if cpu_runtime.applied():
        raise RuntimeError(
            "mcore_npu.training.npu_calls.apply(): the CPU runtime is applied in this process; "
            "call mcore_npu.cpu.revert() first (one runtime per process)"
        )
    _STATE.device = torch.device(device)
    _STATE.originals = install(PATCHES)
    _STATE.mode = FUNCTION_MODE[0](_STATE.device)
    _STATE.mode.__enter__()


def revert() -> None:
    """Undo ``apply()``: every replaced attribute is its original object again."""
    if not applied():
        return
    _STATE.mode.__exit__(None, None, None)
    restore(PATCHES, _STATE.originals)
    _STATE.originals, _STATE.mode, _STATE.device = [], None, None
