"""verl's ``param_offload`` for a model without DDP (the reference model) on a host-only machine.

verl moves a model that is not wrapped in Megatron's DDP (``forward_only=True``: the reference
model, whose ``param_offload`` follows the actor's) to the host with
``offload_megatron_model_to_cpu`` (``verl/utils/megatron_utils.py:779-790``)::

    old_data = param.data
    param.data = param.data.to("cpu")
    if _can_safely_resize_storage(old_data):
        old_data.storage().resize_(0)

On an NPU ``.to("cpu")`` is a copy and the resize frees the device copy. On a machine without
an accelerator (CPU runs and this project's tests) the parameter is already on the CPU,
``.to("cpu")`` returns the same storage, and the resize frees the only copy of the weights: the
next forward fails with "storage of size 0". The DDP-wrapped actor is not affected (verl copies
its flat buffers into a separate ``cpu_data`` tensor first).

:func:`round_trip_on_host` does the same move on such a machine with real copies: offloading
copies every parameter into new host storage and frees the old one, loading copies it back into
new storage and frees the host copy, so the weights survive and the round trip is a real one
(bit-exact: a copy). The engine calls it in place of verl's model move only there; on an NPU
(or CUDA) verl's own code runs unchanged.
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
    the old storage: the offload or the load of verl's non-DDP path, as real copies.

    Returns the number of bytes copied.
    """
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
