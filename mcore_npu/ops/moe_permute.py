"""torch_npu's MoE token permute / unpermute operators in plain PyTorch: signatures, refusals,
autograd.

Routing-map pair (op-plugin >= 7.2.0; Megatron's ``moe_utils.permute(..., routing_map)`` /
``unpermute``)::

    npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None,
        num_out_tokens=None, drop_and_pad=False) -> (permuted_tokens, permuted_probs,
        sorted_indices)
    npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *,
        probs=None, routing_map=None, drop_and_pad=False) -> unpermuted_tokens

    tokens           [T, H]   float16 | bfloat16 | float32 (float64: reference only)
    routing_map      [T, E]   bool; True = token t is routed to expert e (polarity: True routes)
    probs            [T, E]   floating; the routing weights (only the routed entries are read)
    permuted_tokens  [N, H]   the tokens grouped by expert (expert 0's first, each expert's in
                              token order); N = routing_map.sum() (drop_and_pad: num_out_tokens)
    permuted_probs   [N]      probs of the same (token, expert) pairs, or None without probs
    sorted_indices   [N]      a handle for the matching unpermute (the reference's: the token
                              index of each permuted row, int64; torch_npu's: int32 in the
                              kernel's own order); never mix kernels between the two calls
    unpermuted       [T, H]   (restore_shape) sum over a token's rows (times its probs if given)

drop_and_pad (Megatron's padded expert capacity): ``capacity = num_out_tokens // E``; each expert
takes its first ``capacity`` tokens in token order, padded with unrouted tokens (routing_map
columns then hold exactly ``capacity`` Trues, Megatron's router guarantees it).

Legacy index pair (op-plugin >= 7.1.0; Megatron <= 0.9's ``permute(tokens, indices)``)::

    npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False)
        -> (permuted_tokens [N, H], sorted_indices [N])
    npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
        restore_shape=None) -> [T, H]

    indices          [T] or [T, K] integer expert ids of each token's K choices
    probs            [T, K] floating weights of those choices (None: K = 1, no weighting)
    sorted_indices   stable argsort of indices.view(-1), cut to num_out_tokens (row r of the
                     permuted tokens is token sorted_indices[r] // K)

``padded_mode=True`` is refused (the reference does not implement it). Every operation is an
ordinary differentiable PyTorch op, so gradients flow to tokens and probs by autograd; the
arithmetic is Megatron's unfused path, operation for operation, so results are bit-identical.
"""

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
        fail(op, ValueError, name, f"must be 2-D, got rank {t.dim()}",
             "flatten the leading dimensions: t.view(-1, t.shape[-1])", shown)  # fmt: skip


def _check_device(op, name, t, ref, shown):
    if t.device != ref.device:
        fail(op, ValueError, name, f"is on {t.device}, the tokens on {ref.device}",
             "move every tensor to one device", shown)  # fmt: skip


def _check_routing_map(op, routing_map, tokens_dim, ref, shown):
    if not isinstance(routing_map, torch.Tensor):
        fail(op, TypeError, "routing_map", f"expected a bool tensor, got "
             f"{type(routing_map).__name__}", "pass the router's [T, E] bool map", shown)  # fmt: skip
    if routing_map.dtype != torch.bool:
        fail(op, TypeError, "routing_map", f"dtype {routing_map.dtype} is not bool (True = token "
             "routed to expert)", "pass routing_map.bool()", shown)  # fmt: skip
    _check_2d(op, "routing_map", routing_map, shown)
    if routing_map.shape[0] != tokens_dim:
        fail(op, ValueError, "routing_map", f"has {routing_map.shape[0]} rows for {tokens_dim} "
             "tokens", "give one row per token: [T, E]", shown)  # fmt: skip
    _check_device(op, "routing_map", routing_map, ref, shown)


def _check_probs(op, probs, shape, kernel, ref, shown, what="[T, E] like routing_map"):
    check_tensor(op, "probs", probs, kernel, shown)
    if tuple(probs.shape) != tuple(shape):
        fail(op, ValueError, "probs", f"shape {list(probs.shape)} is not {list(shape)}",
             f"pass the routing weights as {what}", shown)  # fmt: skip
    _check_device(op, "probs", probs, ref, shown)


def _check_bool(op, name, value, shown):
    if not isinstance(value, bool):
        fail(op, TypeError, name, f"expected a bool, got {type(value).__name__} ({value!r})",
             f"pass {name}=True or False", shown)  # fmt: skip


def _count(op, name, value, shown):
    """``value`` as an int (a 0-d integer tensor is read on the host), or None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = int(value.item())
    if not is_int(value):
        fail(op, TypeError, name, f"expected an int or None, got {type(value).__name__}",
             "pass the number of permuted rows as an int", shown)  # fmt: skip
    if value < 0:
        fail(op, ValueError, name, f"{value} is negative", "pass a count >= 0", shown)
    return int(value)


def validate_permute_with_routing_map(tokens, routing_map, *, probs=None, num_out_tokens=None,
                                      drop_and_pad=False, kernel="reference"):  # fmt: skip
    """Check one permute call; returns the capacity per expert (drop_and_pad) or None.

    Raises:
        TypeError, ValueError: naming the argument, with what to do instead.
    """
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
        fail(PERMUTE, ValueError, "num_out_tokens", f"{count} is not a multiple of the {experts} "
             "experts (drop_and_pad gives every expert the same capacity)",
             "pass num_out_tokens = capacity * num_experts", shown)  # fmt: skip
    if count // experts > tokens.shape[0]:
        fail(PERMUTE, ValueError, "num_out_tokens", f"a capacity of {count // experts} exceeds "
             f"the {tokens.shape[0]} tokens", "pass a capacity <= the number of tokens",
             shown)  # fmt: skip
    return count // experts


def npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None,
                                           num_out_tokens=None, drop_and_pad=False):  # fmt: skip
    """Group ``tokens`` [T, H] by expert per ``routing_map`` [T, E] (True = routed); see the
    module doc. Returns ``(permuted_tokens [N, H], permuted_probs [N] | None, sorted_indices)``.

    Example::

        >>> x = torch.arange(3.0).view(3, 1); m = torch.tensor([[1, 1], [0, 1], [1, 0]]).bool()
        >>> npu_moe_token_permute_with_routing_map(x, m)[0].view(-1).tolist()
        [0.0, 2.0, 0.0, 1.0]
    """
    capacity = validate_permute_with_routing_map(tokens, routing_map, probs=probs,
                                                 num_out_tokens=num_out_tokens,
                                                 drop_and_pad=drop_and_pad)  # fmt: skip
    num_tokens, experts = routing_map.shape
    permuted_probs = None
    if capacity is not None:
        by_expert = routing_map.to(torch.int8).T.contiguous()  # [E, T]
        # routed tokens first (in token order), then the padding ones
        chosen = by_expert.argsort(dim=-1, descending=True, stable=True)[:, :capacity]
        sorted_indices = chosen.contiguous().view(-1)  # [E * capacity]
        if probs is not None:
            flat = probs.T.contiguous().view(-1)  # [E * T]
            rows = torch.arange(experts, device=routing_map.device).unsqueeze(-1)
            positions = (rows * num_tokens + sorted_indices.view(experts, capacity)).view(-1)
            permuted_probs = flat.index_select(0, positions)
    else:
        by_expert = routing_map.bool().T.contiguous()  # [E, T]
        token_ids = torch.arange(num_tokens, device=routing_map.device)
        sorted_indices = token_ids.unsqueeze(0).expand(experts, -1).masked_select(by_expert)
        if probs is not None:
            permuted_probs = probs.T.contiguous().masked_select(by_expert)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def _restore_shape(op, restore_shape, hidden, shown):
    if not (isinstance(restore_shape, (tuple, list, torch.Size)) and len(restore_shape) == 2
            and all(is_int(v) for v in restore_shape)):  # fmt: skip
        fail(op, TypeError, "restore_shape", f"expected two ints [T, H], got {restore_shape!r}",
             "pass the tokens' shape before permute, e.g. tokens.shape", shown)  # fmt: skip
    rows, width = (int(v) for v in restore_shape)
    if rows < 0 or width != hidden:
        fail(op, ValueError, "restore_shape", f"[{rows}, {width}] does not fit permuted tokens "
             f"of hidden size {hidden}", "pass [T, H] with H = permuted_tokens.shape[1]",
             shown)  # fmt: skip
    return rows, width


def _check_indices(op, name, indices, rows, ref, shown, ranks=(1,)):
    if not isinstance(indices, torch.Tensor) or indices.dtype not in INDEX_DTYPES:
        got = indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__
        fail(op, TypeError, name, f"expected an int32 / int64 tensor, got {got}",
             "pass the indices the matching permute returned", shown)  # fmt: skip
    if indices.dim() not in ranks:
        fail(op, ValueError, name, f"rank {indices.dim()} is not one of {list(ranks)}",
             "pass the indices the matching permute returned", shown)  # fmt: skip
    if rows is not None and indices.shape[0] != rows:
        fail(op, ValueError, name, f"has {indices.shape[0]} entries for {rows} permuted rows",
             "pass the sorted_indices of the permute that made these rows", shown)  # fmt: skip
    _check_device(op, name, indices, ref, shown)


def validate_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *,
                                        probs=None, routing_map=None, drop_and_pad=False,
                                        kernel="reference"):  # fmt: skip
    """Check one unpermute call; returns ``restore_shape`` as ``(T, H)``.

    Raises:
        TypeError, ValueError: naming the argument, with what to do instead.
    """
    t = permuted_tokens
    shown = (("permuted_tokens", t), ("sorted_indices", sorted_indices), ("probs", probs),
             ("routing_map", routing_map))  # fmt: skip
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
        fail(UNPERMUTE, ValueError, "routing_map", "is None but probs are given: the map says "
             "which probs belong to which permuted row", "pass the routing_map given to permute",
             shown)  # fmt: skip
    _check_probs(UNPERMUTE, probs, routing_map.shape, kernel, t, shown)
    experts = routing_map.shape[1]
    if drop_and_pad and (experts == 0 or t.shape[0] % experts):
        fail(UNPERMUTE, ValueError, "permuted_tokens", f"{t.shape[0]} rows are not a multiple of "
             f"the {experts} experts (drop_and_pad)", "pass the rows drop_and_pad permute made",
             shown)  # fmt: skip
    return rows, t.shape[1]


def npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *,
                                             probs=None, routing_map=None,
                                             drop_and_pad=False):  # fmt: skip
    """Sum the permuted rows [N, H] back into ``restore_shape`` [T, H] (rows weighted by the
    routed ``probs`` [T, E] when given; ``routing_map`` True = routed); see the module doc."""
    restore = validate_unpermute_with_routing_map(
        permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
        drop_and_pad=drop_and_pad,
    )  # fmt: skip
    input_dtype = permuted_tokens.dtype
    if probs is not None:
        num_tokens, experts = routing_map.shape
        if drop_and_pad:
            capacity = sorted_indices.shape[0] // experts
            flat = probs.T.contiguous().view(-1)  # [E * T]
            rows = torch.arange(experts, device=routing_map.device).unsqueeze(-1)
            positions = (rows * num_tokens + sorted_indices.view(experts, capacity)).view(-1)
            permuted_probs = flat.index_select(0, positions)
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
        fail(op, ValueError, "padded_mode", "True is not implemented by the reference (and not "
             "used by Megatron-Core's dispatchers)", "pass padded_mode=False; for expert "
             "capacity use the routing-map pair with drop_and_pad=True", shown)  # fmt: skip


def validate_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False, *,
                           kernel="reference") -> int:  # fmt: skip
    """Check one legacy permute call; returns K (choices per token)."""
    shown = (("tokens", tokens), ("indices", indices))
    check_tensor(LEGACY_PERMUTE, "tokens", tokens, kernel, shown)
    _check_2d(LEGACY_PERMUTE, "tokens", tokens, shown)
    _check_indices(LEGACY_PERMUTE, "indices", indices, tokens.shape[0], tokens, shown, (1, 2))
    _refuse_padded(LEGACY_PERMUTE, padded_mode, shown)
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    count = _count(LEGACY_PERMUTE, "num_out_tokens", num_out_tokens, shown)
    if count is not None and count > indices.numel():
        fail(LEGACY_PERMUTE, ValueError, "num_out_tokens", f"{count} exceeds the "
             f"{indices.numel()} (token, choice) pairs", "pass at most T * K", shown)  # fmt: skip
    return topk


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """Legacy index-based permute: ``tokens`` [T, H], ``indices`` [T, K] expert ids ->
    ``(permuted_tokens [N, H], sorted_indices [N])`` (see the module doc)."""
    topk = validate_token_permute(tokens, indices, num_out_tokens, padded_mode)
    sorted_indices = torch.argsort(indices.reshape(-1), stable=True)
    count = _count(LEGACY_PERMUTE, "num_out_tokens", num_out_tokens, ())
    if count is not None:
        sorted_indices = sorted_indices[:count]
    return tokens.index_select(0, sorted_indices // topk), sorted_indices


def validate_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                             restore_shape=None, *, kernel="reference") -> tuple[int, int]:  # fmt: skip
    """Check one legacy unpermute call; returns ``(pairs, K)``: rows before summing, choices."""
    t = permuted_tokens
    shown = (("permuted_tokens", t), ("sorted_indices", sorted_indices), ("probs", probs))
    check_tensor(LEGACY_UNPERMUTE, "permuted_tokens", t, kernel, shown)
    _check_2d(LEGACY_UNPERMUTE, "permuted_tokens", t, shown)
    _check_indices(LEGACY_UNPERMUTE, "sorted_indices", sorted_indices, t.shape[0], t, shown)
    _refuse_padded(LEGACY_UNPERMUTE, padded_mode, shown)
    if probs is not None:
        check_tensor(LEGACY_UNPERMUTE, "probs", probs, kernel, shown)
        if probs.dim() != 2:
            fail(LEGACY_UNPERMUTE, ValueError, "probs", f"must be 2-D [T, K], got rank "
                 f"{probs.dim()}", "pass the weights of each token's K choices", shown)  # fmt: skip
        _check_device(LEGACY_UNPERMUTE, "probs", probs, t, shown)
        pairs, topk = probs.numel(), probs.shape[1]
    else:
        pairs, topk = t.shape[0], 1
    if t.shape[0] > pairs:
        fail(LEGACY_UNPERMUTE, ValueError, "permuted_tokens", f"{t.shape[0]} rows exceed the "
             f"{pairs} (token, choice) pairs of probs", "pass the rows permute made", shown)  # fmt: skip
    if restore_shape is not None:
        _restore_shape(LEGACY_UNPERMUTE, restore_shape, t.shape[1], shown)
        if int(restore_shape[0]) != pairs // topk:
            fail(LEGACY_UNPERMUTE, ValueError, "restore_shape", f"{int(restore_shape[0])} rows, "
                 f"but the call restores {pairs // topk}", "pass None or [T, H]", shown)  # fmt: skip
    return pairs, topk


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                            restore_shape=None):  # fmt: skip
    """Legacy unpermute: put row r back at pair ``sorted_indices[r]``, weight each token's K
    pairs by ``probs`` [T, K] and sum them -> [T, H] (see the module doc)."""
    pairs, topk = validate_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode,
                                           restore_shape)  # fmt: skip
    hidden = permuted_tokens.shape[1]
    out = permuted_tokens.new_zeros(pairs, hidden)
    out = out.index_copy(0, sorted_indices.long(), permuted_tokens).view(-1, topk, hidden)
    if probs is not None:
        out = out * probs.unsqueeze(-1)
    return out.sum(dim=1).to(permuted_tokens.dtype)
