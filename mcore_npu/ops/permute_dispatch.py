"""Dispatch of the MoE token permute operators: ``kernel = auto | torch_npu | reference``.

- :func:`moe_token_permute_with_routing_map` / :func:`moe_token_unpermute_with_routing_map`
  -> ``torch_npu.npu_moe_token_(un)permute_with_routing_map`` or the references in
  :mod:`mcore_npu.ops.moe_permute`
- :func:`moe_token_permute` / :func:`moe_token_unpermute` -> the legacy index-based pair

Every call is validated first (the same checks for both kernels). Which kernel runs is
:func:`resolve_permute_kernel`'s answer: ``"auto"`` on NPU tensors takes torch_npu when the
installed torch_npu has the operator pair, and otherwise **falls back to the unfused path** with
one warning per process (as MindSpeed does): here the reference, in the MoE layer Megatron's own
``permute`` / ``unpermute``. ``kernel="torch_npu"`` without the operators is refused.
"""

from __future__ import annotations

import torch

from mcore_npu._warnings import warn_once
from mcore_npu.ops import moe_permute as mp

UNFUSED = "unfused"
"""What :func:`resolve_permute_kernel` answers when ``auto`` falls back (torch_npu lacks the ops)."""


def installed_permute_ops(torch_npu) -> dict[str, bool]:
    """Which of the four permute operators ``torch_npu`` (a module) has, by name."""
    return {name: callable(getattr(torch_npu, name, None)) for name in (*mp.ROUTING_MAP_OPS,
                                                                       *mp.LEGACY_OPS)}  # fmt: skip


def resolve_permute_kernel(kernel: str, device: torch.device, ops=mp.ROUTING_MAP_OPS) -> str:
    """``"torch_npu"``, ``"reference"`` or ``"unfused"`` (auto's fallback) for ``ops``.

    Raises:
        ValueError: unknown ``kernel``, or ``"torch_npu"`` and the installed torch_npu lacks
            one of ``ops`` (with the fix).
    """
    from mcore_npu.ops import load_torch_npu, resolve_kernel

    chosen = resolve_kernel(kernel, device)
    if chosen != "torch_npu":
        return chosen
    present = installed_permute_ops(load_torch_npu())
    missing = [name for name in ops if not present[name]]
    if not missing:
        return "torch_npu"
    if kernel == "auto":
        warn_once(f"moe-permute-fallback:{','.join(missing)}",
                  f"moe permute fusion: the installed torch_npu has no {', '.join(missing)} "
                  "(op-plugin >= 7.2.0 has them); using the unfused permute instead (same "
                  "results, slower). Upgrade torch-npu to get the fused operators.")  # fmt: skip
        return UNFUSED
    raise ValueError(
        f"kernel: 'torch_npu' needs torch_npu.{missing[0]}, which the installed torch_npu lacks "
        "(op-plugin >= 7.2.0 has the routing-map pair, >= 7.1.0 the index pair); upgrade "
        "torch-npu, or pass kernel='auto' (falls back to the unfused path) or 'reference'"
    )


def _device(t) -> torch.device:
    return getattr(t, "device", torch.device("cpu"))


def moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None, num_out_tokens=None,
                                       drop_and_pad=False, kernel="auto"):  # fmt: skip
    """``npu_moe_token_permute_with_routing_map`` on the chosen kernel: tokens [T, H] grouped by
    expert per routing_map [T, E] (True = routed) -> ``(permuted [N, H], probs [N] | None,
    sorted_indices [N])``; see :mod:`mcore_npu.ops.moe_permute`."""
    chosen = resolve_permute_kernel(kernel, _device(tokens))
    kwargs = dict(probs=probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad)
    mp.validate_permute_with_routing_map(tokens, routing_map, **kwargs, kernel=chosen)
    if chosen == "torch_npu":
        from mcore_npu.ops import load_torch_npu

        return load_torch_npu().npu_moe_token_permute_with_routing_map(tokens, routing_map,
                                                                        **kwargs)  # fmt: skip
    return mp.npu_moe_token_permute_with_routing_map(tokens, routing_map, **kwargs)


def moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *,
                                         probs=None, routing_map=None, drop_and_pad=False,
                                         kernel="auto"):  # fmt: skip
    """``npu_moe_token_unpermute_with_routing_map`` on the chosen kernel: permuted rows [N, H]
    summed back into ``restore_shape`` [T, H], weighted by probs [T, E] where given."""
    chosen = resolve_permute_kernel(kernel, _device(permuted_tokens))
    kwargs = dict(probs=probs, routing_map=routing_map, drop_and_pad=drop_and_pad)
    mp.validate_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape,
                                           **kwargs, kernel=chosen)  # fmt: skip
    if chosen == "torch_npu":
        from mcore_npu.ops import load_torch_npu

        op = load_torch_npu().npu_moe_token_unpermute_with_routing_map
        return op(permuted_tokens, sorted_indices, restore_shape, **kwargs)
    return mp.npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices,
                                                       restore_shape, **kwargs)  # fmt: skip


def moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False, *, kernel="auto"):
    """Legacy ``npu_moe_token_permute``: tokens [T, H], indices [T, K] expert ids ->
    ``(permuted [N, H], sorted_indices [N])`` on the chosen kernel."""
    chosen = resolve_permute_kernel(kernel, _device(tokens), mp.LEGACY_OPS)
    mp.validate_token_permute(tokens, indices, num_out_tokens, padded_mode, kernel=chosen)
    if chosen == "torch_npu":
        from mcore_npu.ops import load_torch_npu

        return load_torch_npu().npu_moe_token_permute(tokens, indices, num_out_tokens,
                                                      padded_mode)  # fmt: skip
    return mp.npu_moe_token_permute(tokens, indices, num_out_tokens, padded_mode)


def moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                        restore_shape=None, *, kernel="auto"):  # fmt: skip
    """Legacy ``npu_moe_token_unpermute``: rows back to their pairs, weighted by probs [T, K],
    summed per token -> [T, H], on the chosen kernel."""
    chosen = resolve_permute_kernel(kernel, _device(permuted_tokens), mp.LEGACY_OPS)
    args = (permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)
    mp.validate_token_unpermute(*args, kernel=chosen)
    if chosen == "torch_npu":
        from mcore_npu.ops import load_torch_npu

        return load_torch_npu().npu_moe_token_unpermute(*args)
    return mp.npu_moe_token_unpermute(*args)
