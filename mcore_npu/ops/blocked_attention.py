"""Exact attention and its softmax statistics in one blocked pass: the statistics path.

Ring attention (context parallelism) needs, per block pair, the output **and** the operator's
outputs 1 and 2: ``softmax_max`` (row max of the scaled, masked scores) and ``softmax_sum``
(``sum exp(score - max)``). PyTorch's fused CPU kernel gives the output and the log-sum-exp but
not the max, and recomputing the max costs another ``Q @ K^T``. This module computes all three
from one score block per group of query rows, with the flops of the fused kernel:

    scores = scale * Q_blk @ K^T      one GEMM (scale applied to the product, as the operator)
    diagonal square masked (causal)   key j > row i -> -inf; blocks above the diagonal skipped
    softmax_max = rowmax(scores)
    P = softmax(scores)               in place, in the score buffer
    softmax_sum = 1 / rowmax(P)       P at the argmax is exp(0) / sum
    out = P @ V                       one GEMM

Blocks are ``BLOCK_ROWS`` query rows of as many KV heads (with their GQA query heads) as fit
``BLOCK_BYTES`` of scores; one score buffer is reused by every block, so the memory beyond the
output and the statistics is that buffer. The output is allocated in the query's memory order,
so turning it back into the call's layout (SBH, BSH, ...) is a view, not a copy.

Covers full attention and top-left causal attention (sparse modes 0/1 without a mask, 2, and 3/4
where they reduce to it), without ``pse`` and without dropout, for any layout, GQA, Dv <= D, on
any device. Computed under ``no_grad`` in float32 (float64 for float64 inputs); the reference
takes another path when autograd must record the output.
"""

from __future__ import annotations

import torch

BLOCK_ROWS = 128
"""Query rows per block (per query head)."""
BLOCK_BYTES = 4 * 2**20
"""Score buffer size: KV heads are grouped per block while their scores fit in it."""


@torch.no_grad()
def attention_with_statistics(q, k, v, causal: bool, scale: float):
    """Softmax attention with the operator's statistics; no row may be without keys (Skv > 0).

    Args:
        q: ``[B, Nq, Sq, D]`` (any strides, e.g. a view of an SBH tensor).
        k: ``[B, Nkv, Skv, D]``, v: ``[B, Nkv, Skv, Dv]``; Nq % Nkv == 0 (query head i reads
            KV head i // (Nq/Nkv)).
        causal: top-left causal (query i sees keys j <= i), else full attention.
        scale: multiplies ``Q @ K^T``.

    Returns:
        ``(out, softmax_max, softmax_sum)``: out ``[B, Nq, Sq, Dv]`` in q's dtype (memory in q's
        dimension order); the statistics float32 ``[B, Nq, Sq, 8]`` (the value repeated 8 times).
    """
    batch, heads_q, seq_q, _ = q.shape
    heads_kv, seq_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
    group = heads_q // heads_kv
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    width = min(seq_q, seq_kv) if causal else seq_kv  # widest score row of any block
    heads, rows = _block_shape(heads_kv, group, seq_q, width, compute.itemsize)
    out = _empty_like_layout(q, head_dim_v)
    row_max = q.new_empty(batch, heads_kv, group, seq_q, dtype=compute)
    inv_sum = torch.empty_like(row_max)
    buffer = q.new_empty(heads * group * rows * width, dtype=compute)
    diagonal = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)  # True = masked
    out5 = out.view(batch, heads_kv, group, seq_q, head_dim_v)
    for b in range(batch):
        for h0 in range(0, heads_kv, heads):
            h1 = min(heads_kv, h0 + heads)
            keys_h, values_h = k[b, h0:h1].to(compute), v[b, h0:h1].to(compute)
            for start in range(0, seq_q, rows):
                at = (b, slice(h0, h1), slice(None), slice(start, min(seq_q, start + rows)))
                q_block = q[b, h0 * group : h1 * group, at[3]].to(compute)  # [h*G, r, D]
                _attend_block(q_block, keys_h, values_h, buffer, start, causal, scale, diagonal,
                              (out5[at], row_max[at], inv_sum[at]))  # fmt: skip
    del buffer  # the score blocks are freed before the statistics are expanded
    expand = (batch, heads_q, seq_q, 8)
    return (
        out,
        row_max.view(batch, heads_q, seq_q).float().unsqueeze(-1).expand(expand).contiguous(),
        inv_sum.reciprocal_().view(batch, heads_q, seq_q).float().unsqueeze(-1).expand(expand)
        .contiguous(),
    )  # fmt: skip


def _attend_block(q_block, keys_h, values_h, buffer, start, causal, scale, diagonal, outs):
    """One block: ``outs = (out [h, G, r, Dv], max [h, G, r], 1 / sum [h, G, r])`` filled."""
    out, max_out, inv_sum_out = outs
    probs = _scores_and_max(q_block, keys_h, buffer, start, causal, scale, diagonal, max_out)
    torch.amax(probs, -1, out=inv_sum_out)
    o = torch.bmm(probs.flatten(1, 2), values_h[:, : probs.shape[-1]])  # [h, G*r, Dv]
    out.copy_(o.view(out.shape))


def _scores_and_max(q_block, keys_h, buffer, start, causal, scale, diagonal, max_out):
    """Softmax probabilities of one block, in ``buffer``; the row max goes to ``max_out``.

    Args:
        q_block: ``[h*G, r, D]`` (query heads of h KV heads, rows start:start+r);
        keys_h: ``[h, Skv, D]``; max_out: ``[h, G, r]``.

    Returns:
        ``[h, G, r, keys]`` probabilities (keys = start + r clipped to Skv when causal, else Skv).
    """
    heads, seq_kv = keys_h.shape[0], keys_h.shape[1]
    group, rows = q_block.shape[0] // heads, q_block.shape[1]
    keys = min(start + rows, seq_kv) if causal else seq_kv
    scores = buffer[: heads * group * rows * keys].view(heads, group * rows, keys)
    zero = scores.new_zeros(())
    q_flat = q_block.reshape(heads, group * rows, -1)  # a view for MHA, a small copy for GQA
    torch.baddbmm(zero, q_flat, keys_h[:, :keys].mT, beta=0.0, alpha=scale, out=scores)
    scores = scores.view(heads, group, rows, keys)
    if causal and start < keys:  # the diagonal square: rows start.., keys start..keys
        scores[..., start:keys].masked_fill_(diagonal[:rows, : keys - start], float("-inf"))
    torch.amax(scores, -1, out=max_out)
    if scores.device.type == "cpu":  # the row-wise CPU kernel may write over its input
        return torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    return torch.softmax(scores, -1)


def _block_shape(heads_kv: int, group: int, seq_q: int, width: int, itemsize: int):
    """``(kv heads, rows)`` per block: BLOCK_ROWS rows of as many heads as fit BLOCK_BYTES.

    Where one KV head's BLOCK_ROWS rows do not fit, fewer rows (at least one).
    """
    rows = max(1, min(seq_q, BLOCK_ROWS))
    per_head = group * rows * max(width, 1) * itemsize
    if per_head > BLOCK_BYTES:
        return 1, max(1, min(rows, BLOCK_BYTES // (group * max(width, 1) * itemsize)))
    return max(1, min(heads_kv, BLOCK_BYTES // per_head)), rows


def _empty_like_layout(q: torch.Tensor, head_dim_v: int) -> torch.Tensor:
    """An empty ``[B, N, S, Dv]`` tensor whose memory orders B, N, S as q's strides do."""
    order = sorted(range(3), key=lambda d: -q.stride(d))  # outermost first; ties keep B, N, S
    shape = (*q.shape[:3], head_dim_v)
    return torch.empty_permuted(shape, (*order, 3), dtype=q.dtype, device=q.device)
