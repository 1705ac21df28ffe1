"""The MoE token permute operators on the kernel the registry picks: ``kernel = auto |
torch_npu | reference``.

- :func:`moe_token_permute_with_routing_map` / :func:`moe_token_unpermute_with_routing_map`
  -> ``torch_npu.npu_moe_token_(un)permute_with_routing_map`` or the references in
  :mod:`mcore_npu.ops.moe_permute` (op-plugin >= 7.2.0 has the pair)
- :func:`moe_token_permute` / :func:`moe_token_unpermute` -> the legacy index-based pair

Every call is validated first (the same checks for both kernels).
"""

from __future__ import annotations

import torch

from mcore_npu.ops import moe_permute as mp
from mcore_npu.ops import registry


def _device(t) -> torch.device:
    return getattr(t, "device", torch.device("cpu"))


def moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None, num_out_tokens=None,
                                       drop_and_pad=False, kernel="auto"):  # fmt: skip
    """``npu_moe_token_permute_with_routing_map`` on the chosen kernel: tokens [T, H] grouped by
    expert per routing_map [T, E] (True = routed) -> ``(permuted [N, H], probs [N] | None,
    sorted_indices [N])``; see :mod:`mcore_npu.ops.moe_permute`."""
    chosen = registry.resolve("moe_token_permute_with_routing_map", kernel, _device(tokens)).kernel
    kwargs = dict(probs=probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad)
    mp.validate_permute_with_routing_map(tokens, routing_map, **kwargs, kernel=chosen)
    if chosen == "torch_npu":
        op = registry.ascend("moe_token_permute_with_routing_map")
        return op(tokens, routing_map, **kwargs)
    return mp.npu_moe_token_permute_with_routing_map(tokens, routing_map, **kwargs)


def moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *,
                                         probs=None, routing_map=None, drop_and_pad=False,
                                         kernel="auto"):  # fmt: skip
    """``npu_moe_token_unpermute_with_routing_map`` on the chosen kernel: permuted rows [N, H]
    summed back into ``restore_shape`` [T, H], weighted by probs [T, E] where given."""
    chosen = registry.resolve("moe_token_unpermute_with_routing_map", kernel,
                              _device(permuted_tokens)).kernel  # fmt: skip
    kwargs = dict(probs=probs, routing_map=routing_map, drop_and_pad=drop_and_pad)
    mp.validate_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape,
                                           **kwargs, kernel=chosen)  # fmt: skip
    if chosen == "torch_npu":
        op = registry.ascend("moe_token_unpermute_with_routing_map")
        return op(permuted_tokens, sorted_indices, restore_shape, **kwargs)
    return mp.npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices,
                                                       restore_shape, **kwargs)  # fmt: skip


def moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False, *, kernel="auto"):
    """Legacy ``npu_moe_token_permute``: tokens [T, H], indices [T, K] expert ids ->
    ``(permuted [N, H], sorted_indices [N])`` on the chosen kernel."""
    chosen = registry.resolve("moe_token_permute", kernel, _device(tokens)).kernel
    mp.validate_token_permute(tokens, indices, num_out_tokens, padded_mode, kernel=chosen)
    if chosen == "torch_npu":
        return registry.ascend("moe_token_permute")(tokens, indices, num_out_tokens, padded_mode)
    return mp.npu_moe_token_permute(tokens, indices, num_out_tokens, padded_mode)


def moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                        restore_shape=None, *, kernel="auto"):  # fmt: skip
    """Legacy ``npu_moe_token_unpermute``: rows back to their pairs, weighted by probs [T, K],
    summed per token -> [T, H], on the chosen kernel."""
    chosen = registry.resolve("moe_token_unpermute", kernel, _device(permuted_tokens)).kernel
    args = (permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)
    mp.validate_token_unpermute(*args, kernel=chosen)
    if chosen == "torch_npu":
        return registry.ascend("moe_token_unpermute")(*args)
    return mp.npu_moe_token_unpermute(*args)
