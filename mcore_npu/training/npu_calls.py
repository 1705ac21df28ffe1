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
from mcore_npu.cpu.patches import Patch, install, restore

__all__ = ["FUNCTION_MODE", "NOT_ON_NPU", "PATCHES", "applied", "apply", "revert"]


# One function per replaced torch.cuda entry point (torch's dynamo keeps a rule per object).


def trainer_device() -> torch.device:
    """``torch.cuda.current_device``: the device ``apply`` was given, the trainer's NPU
    (Megatron passes it on as ``device=``)."""
    return _STATE.device


def npu_synchronize(device=None) -> None:
    """``torch.cuda.synchronize``."""
    torch.npu.synchronize(device)


def npu_stream_class():
    """``torch.cuda.Stream``: ``torch.npu.Stream`` (looked up when the table is applied)."""
    return torch.npu.Stream


def npu_current_stream(device=None):
    """``torch.cuda.current_stream``."""
    return torch.npu.current_stream(device)


def npu_stream(stream=None):
    """``torch.cuda.stream(s)``: the NPU stream context."""
    return torch.npu.stream(stream)


def npu_set_device(device) -> None:
    """``torch.cuda.set_device``."""
    torch.npu.set_device(device)


def make_npu_rng_tracker():
    """Megatron's RNG tracker whose named streams are states of the current NPU's generator."""
    return shims.rng_tracker_on(torch.npu)


def get_npu_rng_state(*args, **kwargs) -> torch.Tensor:
    """Megatron's ``_get_cuda_rng_state``: the current NPU generator's state."""
    return torch.npu.get_rng_state()


def set_npu_rng_state(state, *args, **kwargs) -> None:
    """Megatron's ``_set_cuda_rng_state``."""
    torch.npu.set_rng_state(state)


def _cuda(name: str, replacement, reason: str, how: str = "value") -> Patch:
    return Patch("torch.cuda", name, replacement, how, reason)


_RANDOM, _OPTIMIZER = "megatron.core.tensor_parallel.random", "megatron.core.optimizer.optimizer"

PATCHES: tuple[Patch, ...] = (
    _cuda("current_device", trainer_device, "Megatron allocates on current_device()"),
    _cuda("synchronize", npu_synchronize, "p2p and checkpoint saving synchronise"),
    _cuda("Stream", npu_stream_class, "the MoE alltoall dispatcher's side stream", "new"),
    _cuda("current_stream", npu_current_stream, "the same dispatcher's default stream"),
    _cuda("stream", npu_stream, "the same dispatcher's stream context"),
    _cuda("set_device", npu_set_device, "DeviceMesh('cuda') selects the device"),
    Patch(_RANDOM, "_CUDA_RNG_STATE_TRACKER", make_npu_rng_tracker, "new",
          "Megatron's named RNG streams (dropout, init) as NPU generator states"),
    Patch(_RANDOM, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True, "value",
          "the tracker above is in place"),
    Patch(_RANDOM, "_get_cuda_rng_state", get_npu_rng_state, "value",
          "full recompute saves the RNG state"),
    Patch(_RANDOM, "_set_cuda_rng_state", set_npu_rng_state, "value",
          "full recompute restores the RNG state"),
    Patch(_OPTIMIZER, "clip_grad_by_total_norm_fp32", shims.clip_grads_without_type_check,
          "value", "gradient clipping asserts torch.cuda.FloatTensor gradients"),
    Patch("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
          shims.with_cuda_type_names, "wrap",
          "its parameter sort compares param.type() with CUDA type names"),
    Patch(_OPTIMIZER, "Float16OptimizerWithFloat16Params.__init__", shims.with_cuda_type_names,
          "wrap", "its parameter sort compares param.type() with CUDA type names"),
)  # fmt: skip

NOT_ON_NPU: dict[tuple[str, str], str] = {
    ("torch.cuda", "mem_get_info"): "verl's; verl asks torch.npu on an NPU",
    ("torch.cuda", "get_device_name"): "verl's; verl asks torch.npu on an NPU",
    ("torch.cuda", "ipc_collect"): "verl's; verl asks torch.npu on an NPU",
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"):
        "gloo's: hccl takes the split sizes as Megatron passes them (as nccl does)",
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim"):
        "gloo's: hccl gathers unequal rows (as nccl does)",
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
