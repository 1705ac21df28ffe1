"""What the CPU runtime replaces, as data: one :class:`Patch` per replaced attribute, and the
two functions that install a table of them and give the originals back.

Nothing else of torch, Megatron or verl is changed, and nothing at all next to an accelerator.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from mcore_npu.cpu import shims


@dataclass(frozen=True)
class Patch:
    """``module.attribute`` (a dotted path inside the module: ``Class.__init__``) replaced by
    ``replacement``: installed as it is (``how="value"``), called with the original
    (``"wrap"``) or called with nothing for a fresh object (``"new"``)."""

    module: str
    attribute: str
    replacement: object
    how: str
    reason: str

    def owner(self):
        """The module or class that holds the attribute."""
        owner = importlib.import_module(self.module)
        for part in self.attribute.split(".")[:-1]:
            owner = getattr(owner, part)
        return owner

    @property
    def name(self) -> str:
        return self.attribute.rsplit(".", 1)[-1]

    def installed(self, original):
        """What goes in place of ``original``."""
        if self.how == "wrap":
            return self.replacement(original)
        return self.replacement() if self.how == "new" else self.replacement


def install(table) -> list:
    """Put every entry of ``table`` in place; returns the originals, in the table's order."""
    originals = []
    for patch in table:
        owner = patch.owner()
        original = (
            vars(owner)[patch.name] if isinstance(owner, type) else getattr(owner, patch.name)
        )
        originals.append(original)
        setattr(owner, patch.name, patch.installed(original))
    return originals


def restore(table, originals) -> None:
    """Give back what :func:`install` returned: every attribute is its original object again."""
    for patch, original in reversed(list(zip(table, originals, strict=True))):
        setattr(patch.owner(), patch.name, original)


def _cuda(name: str, replacement, reason: str) -> Patch:
    return Patch("torch.cuda", name, replacement, "value", reason)


_RANDOM, _OPTIMIZER = "megatron.core.tensor_parallel.random", "megatron.core.optimizer.optimizer"

PATCHES: tuple[Patch, ...] = (
    _cuda("current_device", shims.cpu_device, "Megatron allocates on current_device()"),
    _cuda("synchronize", shims.synchronize_nothing, "p2p and checkpoint saving synchronise"),
    _cuda("Stream", shims.CpuStream, "the MoE alltoall dispatcher's side stream"),
    _cuda("current_stream", shims.current_cpu_stream, "the same dispatcher's default stream"),
    _cuda("stream", shims.on_cpu_stream, "the same dispatcher's stream context"),
    _cuda("mem_get_info", shims.no_device_memory, "verl's log_gpu_memory_usage"),
    _cuda("get_device_name", shims.cpu_device_name, "verl's FLOPs counter (its table has CPU)"),
    _cuda("set_device", shims.select_no_device, "DeviceMesh('cuda') and verl's Ray workers"),
    _cuda("ipc_collect", shims.collect_nothing, "verl's aggressive_empty_cache"),
    Patch(_RANDOM, "_CUDA_RNG_STATE_TRACKER", shims.make_cpu_rng_tracker, "new",
          "Megatron's named RNG streams (dropout, init) as CPU generator states"),
    Patch(_RANDOM, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True, "value",
          "the tracker above is in place"),
    Patch(_RANDOM, "_get_cuda_rng_state", shims.get_cpu_rng_state, "value",
          "full recompute saves the RNG state"),
    Patch(_RANDOM, "_set_cuda_rng_state", shims.set_cpu_rng_state, "value",
          "full recompute restores the RNG state"),
    Patch(_OPTIMIZER, "clip_grad_by_total_norm_fp32", shims.clip_grads_without_type_check, "value",
          "gradient clipping asserts torch.cuda.FloatTensor gradients"),
    Patch("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
          shims.splits_to_host, "value",
          "the alltoall dispatcher's split sizes reach all_to_all_single as numbers"),
    Patch("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim",
          shims.UnevenGatherOnGloo, "wrap",
          "gloo's all_gather refuses the unequal rows of the dispatcher under EP x TP"),
    Patch("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
          shims.with_cuda_type_names, "wrap",
          "its parameter sort compares param.type() with CUDA type names"),
    Patch(_OPTIMIZER, "Float16OptimizerWithFloat16Params.__init__", shims.with_cuda_type_names,
          "wrap", "its parameter sort compares param.type() with CUDA type names"),
)  # fmt: skip

FUNCTION_MODE = (
    shims.CudaFactoriesOnCpu,
    "device='cuda' in torch factory calls and Tensor.to('cuda') -> the CPU; pin_memory dropped; "
    "Tensor.cuda() a no-op",
)
"""The torch function mode ``apply()`` enters (thread-local: see ``apply_in_new_threads``)."""
