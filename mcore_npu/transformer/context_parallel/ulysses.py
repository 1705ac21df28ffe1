"""``cp_comm_type="a2a"`` (Ulysses): trade the sequence split for a head split.

An all-to-all turns ``[s/CP, b, np, hn]`` (local chunks) into ``[s, b, np/CP, hn]`` (whole
sequence, 1/CP of the heads), the chunk order is undone, attention runs as without CP, and
a second all-to-all brings the output back. Query heads and KV groups must divide by CP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_npu.masks import compressed_causal_mask
from mcore_npu.ops import fusion_attention
from mcore_npu.transformer.context_parallel import chunks


def _seq_to_heads(x, group):
    """``[s_local, b, n, d]`` -> ``[s, b, n/CP, d]``, natural token order."""
    size = dist.get_world_size(group)
    s_local, b, n, d = x.shape
    parts = x.reshape(s_local, b, size, n // size, d).permute(2, 0, 1, 3, 4)  # [CP, s_l, ...]
    received = chunks.all_to_all(parts, group)  # [CP (source rank), s_l, b, n/CP, d]
    ranked = received.reshape(size * s_local, b, n // size, d)
    return chunks.reorder_chunks(ranked, chunks.natural_index(size, x.device), 2 * size)


def _heads_to_seq(x, group):
    """``[s, b, n/CP, d]`` (natural order) -> ``[s_local, b, n, d]``: the inverse."""
    size = dist.get_world_size(group)
    s, b, n_local, d = x.shape
    ranked = chunks.reorder_chunks(x, chunks.rank_index(size, x.device), 2 * size)
    received = chunks.all_to_all(ranked.reshape(size, s // size, b, n_local, d), group)
    # [CP (head group), s_l, b, n/CP, d] -> [s_l, b, CP, n/CP, d] -> [s_l, b, n, d]
    return received.permute(1, 2, 0, 3, 4).reshape(s // size, b, size * n_local, d)


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def check_heads(heads: int, groups: int, cp_size: int) -> None:
    """Refuse head counts that an all-to-all over ``cp_size`` ranks cannot split."""
    for name, count in (("query heads", heads), ("KV groups", groups)):
        if count % cp_size:
            raise ValueError(
                f"cp_comm_type='a2a': {count} {name} per tensor-parallel rank do not divide by "
                f"context_parallel_size={cp_size}; Ulysses gives each CP rank 1/CP of the heads."
                " fix: choose a CP size that divides both heads and groups, or cp_comm_type="
                "'p2p' / 'all_gather'"
            )


def attention(
    query, key, value, group, *, heads, scale, causal, kernel, keep_prob=1.0, thd_ends=None,
    window=None,
):  # fmt: skip
    """Context-parallel attention by all-to-all, sbhd: ``[s_local, b, np, hn]`` in and
    ``[s_local, b, np * hn]`` out."""
    _refuse_thd_or_window(thd_ends, window)
    size = dist.get_world_size(group)
    check_heads(heads, key.shape[2], size)
    q, k, v = (SeqToHeads.apply(t, group) for t in (query, key, value))  # [s, b, n/CP, hn]
    kwargs = dict(kernel=kernel, scale=scale, keep_prob=keep_prob)
    if causal:
        kwargs.update(atten_mask=compressed_causal_mask(query.device), sparse_mode=2)
    out = fusion_attention(q.flatten(2), k.flatten(2), v.flatten(2), heads // size, "SBH",
                           **kwargs)  # fmt: skip
    out = HeadsToSeq.apply(out.unflatten(-1, (heads // size, -1)), group)  # [s_l, b, np, hn]
    return out.flatten(2)


def _refuse_thd_or_window(thd_ends, window) -> None:
    if thd_ends is not None or window is not None:
        raise NotImplementedError(
            f"cp_comm_type='a2a' is built for sbhd without sliding windows (got "
            f"{'packed (thd) sequences' if thd_ends is not None else f'window_size={window}'}); "
            "fix: cp_comm_type='all_gather', or context_parallel_size=1"
        )
