"""The reference of ``sparse_flash_attention``, flash-attention style: the forward and backward
work one block of ``QUERY_BLOCK`` queries and one KV head at a time, gathering that block's
``[block, K * sparse_block_size, D]`` keys, and save each query's softmax max and sum, never the
gathered keys."""

from __future__ import annotations

import functools

import torch

from mcore_npu.ops.dsa.layout import ATTENTION, QUERY_BLOCK, segments, sequence


def sparse_attention_reference(
    query,
    key,
    value,
    sparse_indices,
    scale_value,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None,
    query_rope=None,
    key_rope=None,
    sparse_block_size=1,
    layout_query="BSND",
    layout_kv="BSND",
    sparse_mode=3,
    attention_mode=2,
    return_softmax_lse=False,
):
    """``(out, softmax_max, softmax_sum)``: out has query's layout with value's D; query ``i``
    attends the keys ``[idx * sparse_block_size, (idx + 1) * sparse_block_size)`` of each of its
    indices (-1: none; keys past the sequence or, in mode 3, after the causal bound are
    dropped), with scores ``(q . k + q_rope . k_rope) * scale_value``. A query that sees no key
    gets zeros. softmax_max / softmax_sum: float32, laid out as the kernel's ``[B, N2, S1, G]``
    (BSND) / ``[N2, T1, G]`` (TND), G = N1 / N2; empty unless ``return_softmax_lse``.
    Differentiable in query, key, value, query_rope and key_rope with its own backward (flash
    attention style: the forward keeps its inputs and each query's softmax max and sum, the
    backward gathers one block of keys again at a time), so no gathered keys stay alive between
    the two; float64 stays float64. ``attention_mode`` changes only the fused kernel's
    scheduling (2: absorbed MLA)."""
    options = dict(
        actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_kv=actual_seq_lengths_kv,
        sparse_block_size=sparse_block_size,
        layout_query=layout_query,
        layout_kv=layout_kv,
        sparse_mode=sparse_mode,
    )
    out, smax, ssum = _ReferenceSparseAttention.apply(
        query, key, value, query_rope, key_rope, sparse_indices, scale_value, options
    )
    n2 = key.shape[-2]
    if not return_softmax_lse:
        return out, smax.new_empty(0).float(), ssum.new_empty(0).float()
    stats, sums = (_kernel_stats_layout(t, layout_query, n2).float() for t in (smax, ssum))
    return out, stats, sums


class _ReferenceSparseAttention(torch.autograd.Function):
    """:func:`sparse_attention_reference`'s forward and backward, flash-attention style, one
    :class:`_Block` (``QUERY_BLOCK`` queries, one KV head) at a time. Saved for the backward:
    the inputs and each query's softmax max and sum (``[*query.shape[:-1]]``, compute dtype),
    no gathered keys; the backward gathers a block's keys again, rebuilds its probabilities from
    the saved max and sum and scatters the keys' gradients back with ``index_add_``."""

    @staticmethod
    def forward(ctx, query, key, value, query_rope, key_rope, sparse_indices, scale_value, options):
        compute = _compute_dtype(query)
        _warm_exp(compute, query.device.type)
        tokens = query.shape[:-1]
        out = query.new_zeros(*tokens, value.shape[-1], dtype=compute)
        smax = query.new_full(tokens, float("-inf"), dtype=compute)  # no key: max -inf, sum 0
        ssum = query.new_zeros(tokens, dtype=compute)
        for block in _blocks(query, key, value, query_rope, key_rope, sparse_indices, options):
            _forward_block(block, scale_value, out, smax, ssum)
            del block  # its gathered keys go before the next block's are gathered
        ctx.save_for_backward(query, key, value, query_rope, key_rope, sparse_indices, smax, ssum)
        ctx.scale_value, ctx.options = scale_value, options
        ctx.mark_non_differentiable(smax, ssum)
        return out.to(query.dtype), smax, ssum

    @staticmethod
    def backward(ctx, grad_out, _grad_max, _grad_sum):
        query, key, value, query_rope, key_rope, indices, smax, ssum = ctx.saved_tensors
        inputs = (query, key, value, query_rope, key_rope)
        compute = _compute_dtype(query)
        grad_out = grad_out.to(compute)
        grads = [
            t.new_zeros(t.shape, dtype=compute) if t is not None and need else None
            for t, need in zip(inputs, ctx.needs_input_grad)
        ]
        for block in _blocks(query, key, value, query_rope, key_rope, indices, ctx.options):
            _backward_block(block, ctx.scale_value, smax, ssum, grad_out, grads)
            del block
        return (
            *(None if g is None else g.to(t.dtype) for g, t in zip(grads, inputs)),
            None,
            None,
            None,
        )


def _probabilities(score, top, denominator=None):
    """``(probabilities, denominator)``: the softmax of ``score`` (``[block, G, M]``) from its
    max ``top`` and, where given, its sum (``[block, G, 1]``; None: summed here); zeros where no
    key counts."""
    weights = (score - torch.where(torch.isfinite(top), top, 0)).exp()
    if denominator is None:
        denominator = weights.sum(-1, keepdim=True)
    return weights / torch.where(denominator > 0, denominator, 1), denominator


def _forward_block(block, scale_value, out, smax, ssum):
    """Write the block's output rows, softmax max and sum into ``out`` / ``smax`` / ``ssum``."""
    score = block.scores(scale_value)
    top = score.amax(-1, keepdim=True)
    probs, denominator = _probabilities(score, top)
    block.rows(out)[:] = torch.einsum("qgm,qmd->qgd", probs, block.v)
    block.rows(smax)[:] = top[..., 0]
    block.rows(ssum)[:] = denominator[..., 0]


def _backward_block(block, scale_value, smax, ssum, grad_out, grads):
    """Add the block's share to ``grads`` (query, key, value, query_rope, key_rope; None: not
    wanted): its probabilities again from the saved max and sum, then the softmax backward."""
    dq, dk, dv, dqr, dkr = grads
    score = block.scores(scale_value)
    probs, _ = _probabilities(score, block.rows(smax)[..., None], block.rows(ssum)[..., None])
    del score
    d_out = block.rows(grad_out)  # [block, G, Dv]
    d_probs = torch.einsum("qgd,qmd->qgm", d_out, block.v)
    block.v = None  # each gathered tensor goes once used: its [block, M, D] term takes its place
    d_score = probs * (d_probs - (probs * d_probs).sum(-1, keepdim=True)) * scale_value
    del d_probs
    if dq is not None:
        block.rows(dq)[:] = torch.einsum("qgm,qmd->qgd", d_score, block.k)
    if dqr is not None:
        block.rows(dqr)[:] = torch.einsum("qgm,qmd->qgd", d_score, block.kr)
    block.k = block.kr = None
    for grad, pulled, by in ((dk, d_score, block.q), (dv, probs, d_out), (dkr, d_score, block.qr)):
        if grad is not None:  # one [block, M, D] term alive at a time
            block.scatter(grad, torch.einsum("qgm,qgd->qmd", pulled, by))


def _compute_dtype(query):
    return torch.float64 if query.dtype == torch.float64 else torch.float32


@functools.cache
def _warm_exp(dtype, device_type):
    """One 1-element ``exp`` per dtype before the first large one. oneMKL 2024.2 (torch's CPU
    wheels) picks each VML function's kernel on its first call; when that call runs on several
    intra-op threads at once, one thread may compute its whole chunk with a low-accuracy kernel
    (pytorch/pytorch#188792; seen here: errors of 1e-4 in half of a block's softmax weights in a
    fresh process). A single-element call picks the kernel on one thread first."""
    torch.ones(1, dtype=dtype, device=device_type).exp()


class _Block:
    """Up to ``QUERY_BLOCK`` queries of one sequence and one KV head: the query rows ``q`` /
    ``qr`` ``[block, G, D]``, the gathered keys ``k`` / ``v`` / ``kr`` ``[block, M, D]``
    (M = K * sparse_block_size, clamped into the sequence), ``keep`` ``[block, M]``: which of
    them count."""

    def __init__(self, q_rows, kv_rows, positions, keep, q, k, v, qr, kr):
        self._q_rows, self._kv_rows, self._positions = q_rows, kv_rows, positions
        self.keep, self.q, self.k, self.v, self.qr, self.kr = keep, q, k, v, qr, kr

    def rows(self, t):
        """A view of this block's queries and query heads in ``t`` (query layout)."""
        return self._q_rows(t)

    def scatter(self, grad, gathered):
        """Add ``gathered`` (``[block, M, D]``, one row per gathered key) into ``grad``'s key
        rows (key layout)."""
        self._kv_rows(grad).index_add_(0, self._positions, gathered.flatten(0, 1))

    def scores(self, scale_value):
        """``[block, G, M]``: ``(q . k + q_rope . k_rope) * scale_value``, -inf where not kept."""
        score = torch.einsum("qgd,qmd->qgm", self.q, self.k)
        if self.qr is not None:
            score = score + torch.einsum("qgd,qmd->qgm", self.qr, self.kr)
        return (score * scale_value).masked_fill(~self.keep[:, None, :], float("-inf"))


def _blocks(query, key, value, query_rope, key_rope, sparse_indices, options):
    """Yield a :class:`_Block` per sequence, query block and KV head, in order. A sequence
    without queries or keys yields none (its rows keep zeros, max -inf and sum 0)."""
    compute = _compute_dtype(query)
    layout_q, layout_kv = options["layout_query"], options["layout_kv"]
    size, mode = options["sparse_block_size"], options["sparse_mode"]
    q_segments = segments(ATTENTION, layout_q, query, options["actual_seq_lengths_query"], "", ())
    k_segments = segments(ATTENTION, layout_kv, key, options["actual_seq_lengths_kv"], "", ())
    n2 = key.shape[-2]
    group = query.shape[-2] // n2
    offsets = torch.arange(size, device=query.device)
    for (b, q0, sq), (kb, k0, skv) in zip(q_segments, k_segments):
        if sq == 0 or skv == 0:
            continue

        def q_seq(t, b=b, q0=q0, sq=sq):
            return sequence(t, layout_q, b, q0, sq)

        def kv_seq(t, kb=kb, k0=k0, skv=skv):
            return sequence(t, layout_kv, kb, k0, skv)

        q, k, v = q_seq(query).to(compute), kv_seq(key).to(compute), kv_seq(value).to(compute)
        qr = None if query_rope is None else q_seq(query_rope).to(compute)
        kr = None if key_rope is None else kv_seq(key_rope).to(compute)
        idx = q_seq(sparse_indices)  # [sq, N2, K]
        for s in range(0, sq, QUERY_BLOCK):
            e = min(s + QUERY_BLOCK, sq)
            # key positions [block, N2, K * size] and which of them count
            chosen = idx[s:e, :, :, None].long()  # int64 one block at a time
            pos = (chosen * size + offsets).flatten(-2)
            keep = (chosen >= 0).expand(-1, -1, -1, size).flatten(-2)
            keep &= pos < skv
            if mode == 3:
                keep &= pos <= torch.arange(s, e, device=query.device)[:, None, None] + (skv - sq)
            pos = pos.clamp(0, skv - 1)
            for h in range(n2):
                flat, heads = pos[:, h].flatten(), slice(h * group, (h + 1) * group)

                def q_rows(t, s=s, e=e, heads=heads):
                    return q_seq(t)[s:e, heads]

                def kv_rows(t, h=h):
                    return kv_seq(t)[:, h]

                # built in the yield: the generator keeps no reference to the gathered keys
                yield _Block(
                    q_rows,
                    kv_rows,
                    flat,
                    keep[:, h],
                    q[s:e, heads],
                    *(_gather(t, h, flat, e - s) for t in (k, v)),
                    None if qr is None else qr[s:e, heads],
                    _gather(kr, h, flat, e - s),
                )


def _gather(t, head, flat, queries):
    """``[queries, M, D]``: the rows ``flat`` of ``t[:, head]`` (None stays None)."""
    return None if t is None else t[:, head].index_select(0, flat).view(queries, -1, t.shape[-1])


def _kernel_stats_layout(stats, layout, kv_heads):
    """``[B, S1, N1]`` / ``[T1, N1]`` -> the kernel's ``[B, N2, S1, G]`` / ``[N2, T1, G]``."""
    if layout == "BSND":
        return stats.unflatten(-1, (kv_heads, -1)).permute(0, 2, 1, 3)
    return stats.unflatten(-1, (kv_heads, -1)).permute(1, 0, 2)
