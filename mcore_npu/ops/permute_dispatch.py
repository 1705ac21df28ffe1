"""The MoE token permute operators on the kernel the registry picks (``kernel = auto |
torch_npu | reference``), each call validated first:

- :func:`moe_token_permute_with_routing_map` / :func:`moe_token_unpermute_with_routing_map`
  -> ``torch_npu.npu_moe_token_(un)permute_with_routing_map`` or the references in
  :mod:`mcore_npu.ops.moe_permute`
- :func:`moe_token_permute` / :func:`moe_token_unpermute` -> the legacy index-based pair
"""

from __future__ import annotations

import torch

from mcore_npu.ops import moe_permute as mp
from mcore_npu.ops import registry


def _device(t) -> torch.device:
    return getattr(t, "device", torch.device("cpu"))


def moe_token_permute_with_routing_map(
    tokens, routing_map, *, probs=None, num_out_tokens=None, drop_and_pad=False, kernel="auto"
):
    """Tokens [T, H] grouped by expert per routing_map [T, E] (True = routed) ->
    ``(permuted [N, H], probs [N] | None, sorted_indices [N])``."""
    chosen = registry.resolve("moe_token_permute_with_routing_map", kernel, _device(tokens)).kernel
    kwargs = dict(probs=probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad)
    mp.validate_permute_with_routing_map(tokens, routing_map, **kwargs, kernel=chosen)
    if chosen == "torch_npu":
        op = registry.ascend("moe_token_permute_with_routing_map")
        return op(tokens, routing_map, **kwargs)
    return mp.npu_moe_token_permute_with_routing_map(tokens, routing_map, **kwargs)


def moe_token_unpermute_with_routing_map(
    permuted_tokens,
    sorted_indices,
    restore_shape,
    *,
    probs=None,
    routing_map=None,
    drop_and_pad=False,
    kernel="auto",
):
    """Permuted rows [N, H] summed back into ``restore_shape`` [T, H], weighted by probs
    [T, E] where given."""
    op = "moe_token_unpermute_with_routing_map"
    chosen = registry.resolve(op, kernel, _device(permuted_tokens)).kernel
    args = (permuted_tokens, sorted_indices, restore_shape)
    kwargs = dict(probs=probs, routing_map=routing_map, drop_and_pad=drop_and_pad)
    mp.validate_unpermute_with_routing_map(*args, **kwargs, kernel=chosen)
    if chosen == "torch_npu":
        return registry.ascend(op)(*args, **kwargs)
    return mp.npu_moe_token_unpermute_with_routing_map(*args, **kwargs)


def moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False, *, kernel="auto"):
    """Legacy ``npu_moe_token_permute``: tokens [T, H], indices [T, K] expert ids ->
    ``(permuted [N, H], sorted_indices [N])``."""
    chosen = registry.resolve("moe_token_permute", kernel, _device(tokens)).kernel
    mp.validate_token_permute(tokens, indices, num_out_tokens, padded_mode, kernel=chosen)
    if chosen == "torch_npu":
        return registry.ascend("moe_token_permute")(tokens, indices, num_out_tokens, padded_mode)
    return mp.npu_moe_token_permute(tokens, indices, num_out_tokens, padded_mode)


def moe_token_unpermute(
    permuted_tokens,
    sorted_indices,
    probs=None,
    padded_mode=False,
    restore_shape=None,
    *,
    kernel="auto",
):
    """Legacy ``npu_moe_token_unpermute``: rows back to their pairs, weighted by probs [T, K],
    summed per token -> [T, H]."""
    chosen = registry.resolve("moe_token_unpermute", kernel, _device(permuted_tokens)).kernel
    args = (permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)
    mp.validate_token_unpermute(*args, kernel=chosen)
    if chosen == "torch_npu":
        return registry.ascend("moe_token_unpermute")(*args)
    return mp.npu_moe_token_unpermute(*args)
