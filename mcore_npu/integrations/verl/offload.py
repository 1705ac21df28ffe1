"""verl's ``param_offload`` for a model without DDP (the reference model) on a host-only machine.

verl moves such a model with ``param.data = param.data.to("cpu")`` then frees the old storage
(``offload_megatron_model_to_cpu``). On a machine without an accelerator ``.to("cpu")`` returns
the same storage, so that frees the only copy of the weights ("storage of size 0" next forward).
:func:`round_trip_on_host` makes the same move with real copies (new host storage, the old freed,
both ways; bit-exact); the engine uses it only there. See docs/verl_engine_io.md.
"""

from __future__ import annotations

import torch

__all__ = ["host_only_model", "round_trip_on_host"]


def host_only_model(module) -> bool:
    """True when ``module`` (verl's list of model chunks) is not DDP-wrapped and this machine
    has no accelerator: the case verl's non-DDP offload destroys."""
    from megatron.core.distributed import DistributedDataParallel

    from mcore_npu.allocator.device import current_accelerator

    if current_accelerator() != "cpu" or not module:
        return False
    return not any(isinstance(chunk, DistributedDataParallel) for chunk in module)


@torch.no_grad()
def round_trip_on_host(module) -> int:
    """Move every parameter (and gradient) of ``module``'s chunks into new host storage and free
    the old storage; returns the number of parameter bytes copied."""
    copied = 0
    for chunk in module:
        for param in chunk.parameters():
            copied += _move(param)
            if param.grad is not None:
                old = param.grad
                param.grad = old.clone()
                _free(old)
    return copied


def _move(param: torch.nn.Parameter) -> int:
    old = param.data
    param.data = old.clone()
    _free(old)
    return old.numel() * old.element_size()


def _free(tensor: torch.Tensor) -> None:
    """Release ``tensor``'s storage when it owns all of it (verl's own safety rule:
    ``_can_safely_resize_storage``), else leave it to the garbage collector."""
    storage = tensor.untyped_storage()
    whole = storage.nbytes() == tensor.numel() * tensor.element_size()
    if whole and tensor.storage_offset() == 0 and tensor.is_contiguous():
        storage.resize_(0)
