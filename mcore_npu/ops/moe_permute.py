"""torch_npu's MoE token permute / unpermute operators in plain PyTorch: signatures, refusals,
autograd (the contract: specs/fused_ops.md). Routing-map pair (Megatron's ``permute`` /
``unpermute`` with a routing map)::

    tokens           [T, H]   float16 | bfloat16 | float32 (float64: reference only)
    routing_map      [T, E]   bool; True = token t is routed to expert e
    probs            [T, E]   the routing weights (only the routed entries are read)
    permuted_tokens  [N, H]   grouped by expert, each expert's in token order; N = routing_map.sum()
    sorted_indices   [N]      each row's token (the handle for unpermute; never mix kernels)

Legacy index pair: ``indices`` [T] or [T, K] expert ids, ``probs`` [T, K], ``sorted_indices`` the
stable argsort of ``indices.view(-1)``. Megatron's unfused arithmetic, operation for operation."""

from __future__ import annotations

import torch

from mcore_npu.ops._checks import check_tensor, fail, is_int

PERMUTE = "npu_moe_token_permute_with_routing_map"
UNPERMUTE = "npu_moe_token_unpermute_with_routing_map"
LEGACY_PERMUTE = "npu_moe_token_permute"
LEGACY_UNPERMUTE = "npu_moe_token_unpermute"
ROUTING_MAP_OPS = (PERMUTE, UNPERMUTE)
LEGACY_OPS = (LEGACY_PERMUTE, LEGACY_UNPERMUTE)
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_2d(op, name, t, shown):
    if t.dim() != 2:
        fix = "flatten the leading dimensions: t.view(-1, t.shape[-1])"
        fail(op, ValueError, name, f"must be 2-D, got rank {t.dim()}", fix, shown)


def _check_device(op, name, t, ref, shown):
    if t.device != ref.device:
        problem = f"is on {t.device}, the tokens on {ref.device}"
        fail(op, ValueError, name, problem, "move every tensor to one device", shown)


def _check_routing_map(op, routing_map, tokens_dim, ref, shown):
    if not isinstance(routing_map, torch.Tensor):
        problem = f"expected a bool tensor, got {type(routing_map).__name__}"
        fail(op, TypeError, "routing_map", problem, "pass the router's [T, E] bool map", shown)
    if routing_map.dtype != torch.bool:
        problem = f"dtype {routing_map.dtype} is not bool (True = token routed to expert)"
        fail(op, TypeError, "routing_map", problem, "pass routing_map.bool()", shown)
    _check_2d(op, "routing_map", routing_map, shown)
    if routing_map.shape[0] != tokens_dim:
        problem = f"has {routing_map.shape[0]} rows for {tokens_dim} tokens"
        fail(op, ValueError, "routing_map", problem, "give one row per token: [T, E]", shown)
    _check_device(op, "routing_map", routing_map, ref, shown)


def _check_probs(op, probs, shape, kernel, ref, shown, what="[T, E] like routing_map"):
    check_tensor(op, "probs", probs, kernel, shown)
    if tuple(probs.shape) != tuple(shape):
        problem = f"shape {list(probs.shape)} is not {list(shape)}"
        fail(op, ValueError, "probs", problem, f"pass the routing weights as {what}", shown)
    _check_device(op, "probs", probs, ref, shown)


def _check_bool(op, name, value, shown):
    if not isinstance(value, bool):
        problem = f"expected a bool, got {type(value).__name__} ({value!r})"
        fail(op, TypeError, name, problem, f"pass {name}=True or False", shown)


def _count(op, name, value, shown):
    """``value`` as an int (a 0-d integer tensor is read on the host), or None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = int(value.item())
    if not is_int(value):
        problem = f"expected an int or None, got {type(value).__name__}"
        fail(op, TypeError, name, problem, "pass the number of permuted rows as an int", shown)
    if value < 0:
        fail(op, ValueError, name, f"{value} is negative", "pass a count >= 0", shown)
    return int(value)


def validate_permute_with_routing_map(
    tokens, routing_map, *, probs=None, num_out_tokens=None, drop_and_pad=False, kernel="reference"
):
    """Check one permute call; returns the capacity per expert (drop_and_pad) or None."""
    shown = (("tokens", tokens), ("routing_map", routing_map), ("probs", probs))
    check_tensor(PERMUTE, "tokens", tokens, kernel, shown)
    _check_2d(PERMUTE, "tokens", tokens, shown)
    _check_routing_map(PERMUTE, routing_map, tokens.shape[0], tokens, shown)
    if probs is not None:
        _check_probs(PERMUTE, probs, routing_map.shape, kernel, tokens, shown)
    _check_bool(PERMUTE, "drop_and_pad", drop_and_pad, shown)
    if not drop_and_pad:
        if not (num_out_tokens is None or isinstance(num_out_tokens, torch.Tensor)):
            _count(PERMUTE, "num_out_tokens", num_out_tokens, shown)
        return None
    count = _count(PERMUTE, "num_out_tokens", num_out_tokens, shown)
    experts = routing_map.shape[1]
    if count is None or experts == 0 or count % experts:
        problem = f"{count} is not a multiple of the {experts} experts "
        problem += "(drop_and_pad gives every expert the same capacity)"
        fix = "pass num_out_tokens = capacity * num_experts"
        fail(PERMUTE, ValueError, "num_out_tokens", problem, fix, shown)
    if count // experts > tokens.shape[0]:
        problem = f"a capacity of {count // experts} exceeds the {tokens.shape[0]} tokens"
        fix = "pass a capacity <= the number of tokens"
        fail(PERMUTE, ValueError, "num_out_tokens", problem, fix, shown)
    return count // experts


def _pair_probs(probs, routing_map, sorted_indices, capacity):
    """drop_and_pad: the probs ``[T, E]`` of the rows ``sorted_indices`` [E * capacity]."""
    num_tokens, experts = routing_map.shape
    flat = probs.T.contiguous().view(-1)  # [E * T]
    rows = torch.arange(experts, device=routing_map.device).unsqueeze(-1)
    positions = (rows * num_tokens + sorted_indices.view(experts, capacity)).view(-1)
    return flat.index_select(0, positions)


def npu_moe_token_permute_with_routing_map(
    tokens, routing_map, *, probs=None, num_out_tokens=None, drop_and_pad=False
):
    """Group ``tokens`` [T, H] by expert per ``routing_map`` [T, E] (True = routed) ->
    ``(permuted_tokens [N, H], permuted_probs [N] | None, sorted_indices [N])``."""
    kwargs = dict(probs=probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad)
    capacity = validate_permute_with_routing_map(tokens, routing_map, **kwargs)
    num_tokens, experts = routing_map.shape
    permuted_probs = None
    if capacity is not None:
        by_expert = routing_map.to(torch.int8).T.contiguous()  # [E, T]
        # routed tokens first (in token order), then the padding ones
        chosen = by_expert.argsort(dim=-1, descending=True, stable=True)[:, :capacity]
        sorted_indices = chosen.contiguous().view(-1)  # [E * capacity]
        if probs is not None:
            permuted_probs = _pair_probs(probs, routing_map, sorted_indices, capacity)
    else:
        by_expert = routing_map.bool().T.contiguous()  # [E, T]
        token_ids = torch.arange(num_tokens, device=routing_map.device)
        sorted_indices = token_ids.unsqueeze(0).expand(experts, -1).masked_select(by_expert)
        if probs is not None:
            permuted_probs = probs.T.contiguous().masked_select(by_expert)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def _restore_shape(op, restore_shape, hidden, shown):
    is_shape = isinstance(restore_shape, (tuple, list, torch.Size))
    if not (is_shape and len(restore_shape) == 2 and all(is_int(v) for v in restore_shape)):
        problem = f"expected two ints [T, H], got {restore_shape!r}"
        fix = "pass the tokens' shape before permute, e.g. tokens.shape"
        fail(op, TypeError, "restore_shape", problem, fix, shown)
    rows, width = (int(v) for v in restore_shape)
    if rows < 0 or width != hidden:
        problem = f"[{rows}, {width}] does not fit permuted tokens of hidden size {hidden}"
        fix = "pass [T, H] with H = permuted_tokens.shape[1]"
        fail(op, ValueError, "restore_shape", problem, fix, shown)
    return rows, width


def _check_indices(op, name, indices, rows, ref, shown, ranks=(1,)):
    returned = "pass the indices the matching permute returned"
    if not isinstance(indices, torch.Tensor) or indices.dtype not in INDEX_DTYPES:
        got = indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__
        fail(op, TypeError, name, f"expected an int32 / int64 tensor, got {got}", returned, shown)
    if indices.dim() not in ranks:
        problem = f"rank {indices.dim()} is not one of {list(ranks)}"
        fail(op, ValueError, name, problem, returned, shown)
    if rows is not None and indices.shape[0] != rows:
        problem = f"has {indices.shape[0]} entries for {rows} permuted rows"
        fix = "pass the sorted_indices of the permute that made these rows"
        fail(op, ValueError, name, problem, fix, shown)
    _check_device(op, name, indices, ref, shown)


def validate_unpermute_with_routing_map(
    permuted_tokens,
    sorted_indices,
    restore_shape,
    *,
    probs=None,
    routing_map=None,
    drop_and_pad=False,
    kernel="reference",
):
    """Check one unpermute call; returns ``restore_shape`` as ``(T, H)``."""
    t = permuted_tokens
    shown = (("permuted_tokens", t), ("sorted_indices", sorted_indices), ("probs", probs))
    shown += (("routing_map", routing_map),)
    check_tensor(UNPERMUTE, "permuted_tokens", t, kernel, shown)
    _check_2d(UNPERMUTE, "permuted_tokens", t, shown)
    _check_indices(UNPERMUTE, "sorted_indices", sorted_indices, t.shape[0], t, shown)
    rows, _ = _restore_shape(UNPERMUTE, restore_shape, t.shape[1], shown)
    _check_bool(UNPERMUTE, "drop_and_pad", drop_and_pad, shown)
    if routing_map is not None:
        _check_routing_map(UNPERMUTE, routing_map, rows, t, shown)
    if probs is None:
        return rows, t.shape[1]
    if routing_map is None:
        problem = "is None but probs are given: "
        problem += "the map says which probs belong to which permuted row"
        fix = "pass the routing_map given to permute"
        fail(UNPERMUTE, ValueError, "routing_map", problem, fix, shown)
    _check_probs(UNPERMUTE, probs, routing_map.shape, kernel, t, shown)
    experts = routing_map.shape[1]
    if drop_and_pad and (experts == 0 or t.shape[0] % experts):
        problem = f"{t.shape[0]} rows are not a multiple of the {experts} experts (drop_and_pad)"
        fix = "pass the rows drop_and_pad permute made"
        fail(UNPERMUTE, ValueError, "permuted_tokens", problem, fix, shown)
    return rows, t.shape[1]


def npu_moe_token_unpermute_with_routing_map(
    permuted_tokens,
    sorted_indices,
    restore_shape,
    *,
    probs=None,
    routing_map=None,
    drop_and_pad=False,
):
    """Sum the permuted rows [N, H] back into ``restore_shape`` [T, H], rows weighted by the
    routed ``probs`` [T, E] when given (``routing_map`` True = routed)."""
    kwargs = dict(probs=probs, routing_map=routing_map, drop_and_pad=drop_and_pad)
    restore = validate_unpermute_with_routing_map(
        permuted_tokens, sorted_indices, restore_shape, **kwargs
    )
    input_dtype = permuted_tokens.dtype
    if probs is not None:
        if drop_and_pad:
            capacity = sorted_indices.shape[0] // routing_map.shape[1]
            permuted_probs = _pair_probs(probs, routing_map, sorted_indices, capacity)
        else:
            permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
        # may promote to the probs' dtype (e.g. float32 router); cast back at the end
        permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    out = torch.zeros(restore, dtype=permuted_tokens.dtype, device=permuted_tokens.device)
    if torch.are_deterministic_algorithms_enabled():
        out.index_add_(0, sorted_indices, permuted_tokens)
    else:
        index = sorted_indices.long().unsqueeze(1).expand(-1, restore[1])
        out.scatter_add_(0, index, permuted_tokens)
    return out.to(dtype=input_dtype)


def _refuse_padded(op, padded_mode, shown):
    _check_bool(op, "padded_mode", padded_mode, shown)
    if padded_mode:
        problem = "True is not implemented by the reference "
        problem += "(and not used by Megatron-Core's dispatchers)"
        fix = "pass padded_mode=False; "
        fix += "for expert capacity use the routing-map pair with drop_and_pad=True"
        fail(op, ValueError, "padded_mode", problem, fix, shown)


def validate_token_permute(
    tokens, indices, num_out_tokens=None, padded_mode=False, *, kernel="reference"
) -> int:
    """Check one legacy permute call; returns K (choices per token)."""
    shown = (("tokens", tokens), ("indices", indices))
    check_tensor(LEGACY_PERMUTE, "tokens", tokens, kernel, shown)
    _check_2d(LEGACY_PERMUTE, "tokens", tokens, shown)
    _check_indices(LEGACY_PERMUTE, "indices", indices, tokens.shape[0], tokens, shown, (1, 2))
    _refuse_padded(LEGACY_PERMUTE, padded_mode, shown)
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    count = _count(LEGACY_PERMUTE, "num_out_tokens", num_out_tokens, shown)
    if count is not None and count > indices.numel():
        problem = f"{count} exceeds the {indices.numel()} (token, choice) pairs"
        fail(LEGACY_PERMUTE, ValueError, "num_out_tokens", problem, "pass at most T * K", shown)
    return topk


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """Legacy index-based permute: ``tokens`` [T, H], ``indices`` [T, K] expert ids ->
    ``(permuted_tokens [N, H], sorted_indices [N])``."""
    topk = validate_token_permute(tokens, indices, num_out_tokens, padded_mode)
    sorted_indices = torch.argsort(indices.reshape(-1), stable=True)
    count = _count(LEGACY_PERMUTE, "num_out_tokens", num_out_tokens, ())
    if count is not None:
        sorted_indices = sorted_indices[:count]
    return tokens.index_select(0, sorted_indices // topk), sorted_indices


def validate_token_unpermute(
    permuted_tokens,
    sorted_indices,
    probs=None,
    padded_mode=False,
    restore_shape=None,
    *,
    kernel="reference",
) -> tuple[int, int]:
    """Check one legacy unpermute call; returns ``(pairs, K)``: rows before summing, choices."""
    op, t = LEGACY_UNPERMUTE, permuted_tokens
    shown = (("permuted_tokens", t), ("sorted_indices", sorted_indices), ("probs", probs))
    check_tensor(op, "permuted_tokens", t, kernel, shown)
    _check_2d(op, "permuted_tokens", t, shown)
    _check_indices(op, "sorted_indices", sorted_indices, t.shape[0], t, shown)
    _refuse_padded(op, padded_mode, shown)
    if probs is not None:
        check_tensor(op, "probs", probs, kernel, shown)
        if probs.dim() != 2:
            problem = f"must be 2-D [T, K], got rank {probs.dim()}"
            fix = "pass the weights of each token's K choices"
            fail(op, ValueError, "probs", problem, fix, shown)
        _check_device(op, "probs", probs, t, shown)
        pairs, topk = probs.numel(), probs.shape[1]
    else:
        pairs, topk = t.shape[0], 1
    if t.shape[0] > pairs:
        problem = f"{t.shape[0]} rows exceed the {pairs} (token, choice) pairs of probs"
        fail(op, ValueError, "permuted_tokens", problem, "pass the rows permute made", shown)
    if restore_shape is not None:
        _restore_shape(op, restore_shape, t.shape[1], shown)
        if int(restore_shape[0]) != pairs // topk:
            problem = f"{int(restore_shape[0])} rows, but the call restores {pairs // topk}"
            fail(op, ValueError, "restore_shape", problem, "pass None or [T, H]", shown)
    return pairs, topk


def npu_moe_token_unpermute(
    permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None
):
    """Legacy unpermute: row r back at pair ``sorted_indices[r]``, each token's K pairs weighted
    by ``probs`` [T, K] and summed -> [T, H]."""
    args = (permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)
    pairs, topk = validate_token_unpermute(*args)
    hidden = permuted_tokens.shape[1]
    out = permuted_tokens.new_zeros(pairs, hidden)
    out = out.index_copy(0, sorted_indices.long(), permuted_tokens).view(-1, topk, hidden)
    if probs is not None:
        out = out * probs.unsqueeze(-1)
    return out.sum(dim=1).to(permuted_tokens.dtype)
