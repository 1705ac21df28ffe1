"""``cp_comm_type="p2p"``: ring attention on Megatron's load-balanced layout, sbhd and thd.

K/V blocks travel around the CP ring, each transfer overlapping the current block's calls
(:func:`.blocks.schedule`); thd runs the same schedule in TND for the whole pack. Partial results
merge through the float32 statistics (m = ``softmax_max``, l = ``softmax_sum``):
``m = max(m_a, m_b)``, ``w = l exp(m_x - m)``, ``out = (out_a w_a + out_b w_b) / (w_a + w_b)``. The
backward runs the same ring with ``fusion_attention_grad`` on the merged output and statistics;
dK/dV travel with their block. See docs/context_parallel.md."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_npu.masks.descriptions import layer_window
from mcore_npu.ops import fusion_attention_grad, fusion_attention_with_stats
from mcore_npu.transformer.context_parallel import chunks, rules
from mcore_npu.transformer.context_parallel.blocks import BOTH, DenseLayout, PackedLayout, schedule

_F32_MIN = torch.finfo(torch.float32).min


def _merge(acc, rows, out_b, m_b, l_b):
    """Merge a block's ``(out [r, ..., n, d] fp32, m, l [r, ..., n, 1])`` into ``acc`` at ``rows``
    (a slice or an index tensor), in place; ``out_b`` is overwritten."""
    m_a, l_a = acc[1][rows], acc[2][rows]
    m = torch.maximum(m_a, m_b)
    w_a, w_b = l_a * torch.exp(m_a - m), l_b * torch.exp(m_b - m)
    total = w_a + w_b
    out_a = acc[0][rows]
    out_a.mul_(w_a / total).add_(out_b.mul_(w_b / total))
    if not isinstance(rows, slice):
        acc[0][rows] = out_a  # an index tensor gathered a copy
    acc[1][rows], acc[2][rows] = m, total


def _add_rows(total, part, rows, grad, tokens: int):
    """``total[rows] += grad`` in float32; the first gradient is kept as it is when it covers every
    row."""
    grad = grad.float()
    if total is None:
        if part == BOTH:
            return grad
        total = grad.new_zeros(tokens, *grad.shape[1:])
    total[rows] += grad
    return total


def _empty_acc(tokens: int, out_b, m_b):
    """Nothing seen yet: out 0, m = float32 min, l = 0 (merges as an empty block)."""
    out = out_b.new_zeros(tokens, *out_b.shape[1:])
    return [
        out,
        m_b.new_full((tokens, *m_b.shape[1:]), _F32_MIN),
        m_b.new_zeros(tokens, *m_b.shape[1:]),
    ]


def _blocks(layout, rank: int, size: int, step: int, left, tokens: int):
    """The operator calls of one ring step (:func:`.blocks.schedule` for this layout)."""
    return schedule(rank, size, step, left=left, chunk=tokens // 2, split_rows=layout.split_rows)


class RingAttention(torch.autograd.Function):
    """q, k, v in ``layout``'s operator form (sbhd: SBH ``[2c, b, n*hn]``; thd: TND ``[t, n, hn]``)
    -> the merged output in the query's form."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, left, kernel, scale):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        tokens = q.shape[0]
        acc = None
        kv = [k, v]  # two messages per hop
        for step in range(size):
            transfer = chunks.RingTransfer(kv, group) if step + 1 < size else None
            for block in _blocks(layout, rank, size, step, left, tokens):
                rows, keys = layout.rows(block.rows), layout.rows(block.keys)
                out_b, m_b, l_b = fusion_attention_with_stats(
                    q[rows],
                    kv[0][keys],
                    kv[1][keys],
                    layout.heads,
                    layout.input_layout,
                    kernel=kernel,
                    scale=scale,
                    **layout.mask_kwargs(block),
                )
                out_b = layout.out_rows(out_b)
                m_b, l_b = layout.stats_rows(m_b, block.rows), layout.stats_rows(l_b, block.rows)
                if acc is None and block.rows == BOTH:
                    acc = [out_b, m_b, l_b]  # covers every local row
                    continue
                if acc is None:
                    acc = _empty_acc(tokens, out_b, m_b)
                _merge(acc, rows, out_b, m_b, l_b)
                del out_b, m_b, l_b  # freed before the next call allocates its block
            if transfer is not None:  # the next block arrived while this one was computed
                kv = transfer.wait()
        out = layout.output(acc[0]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc[1], acc[2])
        ctx.group, ctx.layout, ctx.left, ctx.kernel, ctx.scale = group, layout, left, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, smax, ssum = ctx.saved_tensors
        group, layout = ctx.group, ctx.layout
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        dout = dout.contiguous()
        tokens = q.shape[0]
        dq = dk = dv = None
        kv = [k, v]
        for step in range(size):
            transfer = chunks.RingTransfer(kv, group) if step + 1 < size else None
            for block in _blocks(layout, rank, size, step, ctx.left, tokens):
                rows, keys = layout.rows(block.rows), layout.rows(block.keys)
                dq_b, dk_b, dv_b, _ = fusion_attention_grad(
                    q[rows],
                    kv[0][keys],
                    kv[1][keys],
                    dout[rows],
                    layout.heads,
                    layout.input_layout,
                    kernel=ctx.kernel,
                    scale_value=ctx.scale,
                    softmax_max=layout.stats_op(smax[rows], block.rows),
                    softmax_sum=layout.stats_op(ssum[rows], block.rows),
                    attention_in=out[rows],
                    **layout.mask_kwargs(block),
                )
                dq = _add_rows(dq, block.rows, rows, dq_b, tokens)
                dk = _add_rows(dk, block.keys, keys, dk_b, tokens)
                dv = _add_rows(dv, block.keys, keys, dv_b, tokens)
                del dq_b, dk_b, dv_b  # freed before the next call (or kept as the sums)
            if transfer is not None:
                kv = transfer.wait()
            # dK/dV travel with their block; the last hop brings them home
            dk, dv = chunks.ring_exchange([_or_zeros(g, t) for g, t in ((dk, k), (dv, v))], group)
        dq = _or_zeros(dq, q)
        grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        return *grads, None, None, None, None, None


def _or_zeros(grad, like: torch.Tensor) -> torch.Tensor:
    """A gradient no block touched (a window that misses a whole step) is float32 zeros."""
    return torch.zeros_like(like, dtype=torch.float32) if grad is None else grad


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
    """Ring attention: sbhd ``[s_local, b, np, hn]`` -> ``[s_local, b, np * hn]``; thd
    (``thd_ends``: local padded cumulative ends without a leading 0, host ints)
    ``[t_local, np, hn]`` -> ``[t_local, np * hn]``. Causal only, without dropout;
    ``window=(left, right)``: a causal sliding window, sbhd only."""
    packed = thd_ends is not None
    size = dist.get_world_size(group)
    rules.check("p2p", size, causal=causal, dropout=1.0 - keep_prob, window=window, packed=packed)
    band = layer_window("causal", window)
    left = None if band is None else band.left
    if not packed:
        layout = DenseLayout(query.shape[0], heads, query.device)
        q, k, v = query.flatten(2), key.flatten(2), value.flatten(2)
        return RingAttention.apply(q, k, v, group, layout, left, kernel, scale)
    _check_thd_ends(thd_ends, query.shape[0])
    layout = PackedLayout(tuple(thd_ends), heads, query.device, memo)
    return RingAttention.apply(query, key, value, group, layout, None, kernel, scale).flatten(1)


def _check_thd_ends(thd_ends, tokens: int) -> None:
    ends = tuple(thd_ends)
    if not ends or not all(isinstance(e, int) for e in ends) or ends[-1] != tokens:
        raise ValueError(
            f"thd_ends: expected host ints, the local padded cumulative ends without a leading 0 "
            f"ending at the local token count {tokens}; got {ends!r}. fix: pass "
            "local_cu_seqlens(cu_seqlens_q_padded, CP)[1:] converted once per step"
        )
