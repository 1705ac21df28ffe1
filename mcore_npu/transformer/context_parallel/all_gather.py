"""``cp_comm_type="all_gather"``: all-gather K/V, each local query chunk attends to its prefix.

Per rank: the local queries (chunks r and 2·CP-1-r of every sequence) against the whole K/V in
natural order; the gather's backward reduce-scatters the K/V gradients. No S×S mask: sbhd makes two
SBH calls (causal: mode 3; window: mode 4; full: one call), thd one TND call whose key segment per
query chunk is laid out by one ``index_select`` of the gathered tokens (built once per batch
layout). See docs/context_parallel.md."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_npu.masks import compressed_causal_mask
from mcore_npu.ops import fusion_attention
from mcore_npu.ops.contract import INT32_MAX
from mcore_npu.transformer.context_parallel import chunks, rules


class GatherSequence(torch.autograd.Function):
    """``[s_local, ...]`` -> ``[s, ...]`` in natural token order; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return chunks.gather_natural(x, group)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        ranked = chunks.reorder_chunks(grad, chunks.rank_index(size, grad.device), 2 * size)
        return chunks.reduce_scatter_seq(ranked, ctx.group), None


class GatherTokens(torch.autograd.Function):
    """``[t_local, ...]`` -> ``[CP * t_local, ...]`` in rank order; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return chunks.all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return chunks.reduce_scatter_seq(grad, ctx.group), None


def attention(
    query,
    key,
    value,
    group,
    *,
    heads,
    scale,
    causal,
    kernel,
    keep_prob=1.0,
    thd_ends=None,
    window=None,
    memo=None,
):
    """Context-parallel attention by all-gather: sbhd ``[s_local, b, np, hn]`` ->
    ``[s_local, b, np * hn]``, thd ``[t_local, np, hn]`` -> ``[t_local, np * hn]``.

    Args:
        causal: causal over each whole sequence (else full attention, or the window alone).
        thd_ends: thd only: the local padded cumulative ends without the leading 0 (host ints).
        window: ``(left, right)`` sliding window (-1 = unbounded), or None.
        memo: the layer's ``SeqLengthsMemo``: the packed index is built once per layout.
    """
    packed = thd_ends is not None
    rules.check(
        "all_gather", dist.get_world_size(group), causal=causal, window=window, packed=packed
    )
    common = dict(kernel=kernel, scale=scale, keep_prob=keep_prob)
    if packed:
        ends = tuple(thd_ends)
        return _thd(query, key, value, group, heads, causal, ends, window, common, memo)
    return _sbhd(query, key, value, group, heads, causal, window, common)


def _sbhd(query, key, value, group, heads, causal, window, common):
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    k = GatherSequence.apply(key, group).flatten(2)  # [s, b, ng*hn], natural order
    v = GatherSequence.apply(value, group).flatten(2)
    q = query.flatten(2)
    if not causal and window is None:
        return fusion_attention(q, k, v, heads, "SBH", **common)
    chunk, seq = query.shape[0] // 2, k.shape[0]
    mask = compressed_causal_mask(query.device)
    outs = []
    for half, chunk_id in enumerate(chunks.chunk_ids(rank, size)):
        start, end = chunk_id * chunk, (chunk_id + 1) * chunk
        first, last, mode = _key_range(start, end, seq, window)
        q_half = q[half * chunk : (half + 1) * chunk]
        keys, values = k[first:last], v[first:last]
        outs.append(
            fusion_attention(q_half, keys, values, heads, "SBH", atten_mask=mask, **mode, **common)
        )
    return torch.cat(outs)


def _key_range(start: int, end: int, seq: int, window) -> tuple[int, int, dict]:
    """Keys ``[first, last)`` of the queries at ``[start, end)`` of a ``seq``-token sequence, and
    the sparse-mode arguments that make the call exact there: causal: the prefix, mode 3; window
    ``(l, r)``: mode 4's bottom-right band, ``pre = l + e``, ``next = r - e`` with
    ``e = last - end``."""
    if window is None:
        return 0, end, {"sparse_mode": 3}
    left, right = window
    first = 0 if left == -1 else max(0, start - left)
    last = seq if right == -1 else min(seq, end + right)
    extra = last - end
    pre = INT32_MAX if left == -1 else left + extra
    nxt = INT32_MAX if right == -1 else right - extra
    return first, last, {"sparse_mode": 4, "pre_tockens": pre, "next_tockens": nxt}


def _thd(query, key, value, group, heads, causal, ends, window, common, memo):
    """Packed: q ``[t_local, np, hn]``, k/v ``[t_local, ng, hn]`` -> ``[t_local, np * hn]``."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    t_local = query.shape[0]
    left = None if window is None or window[0] == -1 else window[0]
    index, q_ends, kv_ends = thd_layout(ends, size, rank, causal, left, query.device, memo)
    k = GatherTokens.apply(key, group).index_select(0, index)  # [Tk, ng, hn]
    v = GatherTokens.apply(value, group).index_select(0, index)
    kwargs = dict(actual_seq_qlen=list(q_ends), actual_seq_kvlen=list(kv_ends), **common)
    if left is not None:
        kwargs.update(
            atten_mask=compressed_causal_mask(query.device),
            sparse_mode=4,
            pre_tockens=left,
            next_tockens=0,
        )
    elif causal:
        kwargs.update(atten_mask=compressed_causal_mask(query.device), sparse_mode=3)
    out = fusion_attention(query, k, v, heads, "TND", **kwargs)
    return out.reshape(t_local, -1)


def _thd_layout_host(ends: tuple[int, ...], size: int, rank: int, causal: bool, left):
    """Host part of :func:`thd_layout`."""
    t_local = ends[-1] if ends else 0
    pieces, q_ends, kv_ends = [], [], []
    start_local = 0
    for end_local in ends:
        length = end_local - start_local  # 2 * c: this rank's two chunks of the sequence
        chunk = length // 2
        if chunk:
            if causal:  # one segment per query chunk, its keys the (windowed) prefix
                for chunk_id in chunks.chunk_ids(rank, size):
                    first = 0 if left is None else max(0, chunk_id * chunk - left)
                    pos = torch.arange(first, (chunk_id + 1) * chunk)
                    pieces.append(_gathered_index(pos, chunk, start_local, size, t_local))
                    q_ends.append((q_ends[-1] if q_ends else 0) + chunk)
                    kv_ends.append((kv_ends[-1] if kv_ends else 0) + pos.numel())
            else:  # full: both chunks as one segment, its keys the whole sequence
                pos = torch.arange(2 * size * chunk)
                pieces.append(_gathered_index(pos, chunk, start_local, size, t_local))
                q_ends.append((q_ends[-1] if q_ends else 0) + length)
                kv_ends.append((kv_ends[-1] if kv_ends else 0) + pos.numel())
        start_local = end_local
    index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return index, tuple(q_ends), tuple(kv_ends)


def _gathered_index(pos, chunk, start_local, size, t_local):
    """Where positions ``pos`` of one sequence (``2·CP`` chunks of ``chunk`` tokens, local offset
    ``start_local``) lie in the rank-ordered gather ``[CP * t_local]``."""
    chunk_id = pos // chunk
    late = chunk_id >= size
    owner = torch.where(late, 2 * size - 1 - chunk_id, chunk_id)
    return owner * t_local + start_local + late.long() * chunk + pos % chunk


def thd_layout(ends, size: int, rank: int, causal: bool, left, device, memo=None):
    """The gather index and TND lengths of one rank's packed attention: ``(index [Tk] int64 into the
    rank-ordered gather, actual_seq_qlen, actual_seq_kvlen)``. ``causal``: one (query chunk, prefix)
    segment per chunk; else one (both chunks, whole sequence) per sequence. ``left``: a causal
    window's left width, or None. Built once per layout with a ``memo``."""
    ends, device = tuple(ends), torch.device(device)

    def build():
        index, q_ends, kv_ends = _thd_layout_host(ends, size, rank, causal, left)
        return index.to(device), q_ends, kv_ends

    key = ("cp_all_gather", ends, size, rank, causal, left, device)
    return chunks.planned(memo, key, build)
