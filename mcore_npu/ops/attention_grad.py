"""A pure-PyTorch reference of ``torch_npu.npu_fusion_attention_grad`` (``scale_value`` where
the forward says ``scale``) -> ``(dq, dk, dv, dpse)``. Given the global statistics and merged
output, a block's call returns its exact share of the gradients (ring attention). With
``s = scale * (Q K^T + pse)`` masked (``atten_mask`` True = masked out), ``lse = softmax_max +
log(softmax_sum)``, ``P = exp(s - lse)``, ``O = attention_in``::

    Delta = rowsum(dY * O)        dP = dY V^T        dS = P * (dP - Delta)
    dQ = scale * dS K             dK = scale * dS^T Q    dV = P^T dY    dpse = scale * dS

Missing statistics or output are recomputed; float32 (float64 for float64), in tiles of query
rows x ``KEY_BLOCK`` keys; ``keep_prob`` must be 1.0 (no replayable dropout stream)."""

from __future__ import annotations

import torch

from mcore_npu.ops.attention_reference import (
    AttentionOptions,
    _from_bnsd,
    _Keep,
    _plan,
    _segment,
    _segment_plan,
    _to_bnsd,
    run_reference,
)
from mcore_npu.ops.validation import split_q_band_segment, validate_call

GRAD_BLOCK_BYTES = 2 * 2**20
"""Largest score tile (``[B, Nq, rows, keys]`` in the compute dtype) of one backward step; a
step holds two (probabilities and score gradients)."""
KEY_BLOCK = 1024
"""Keys of one tile: the work space does not grow with the sequence."""

__all__ = ["npu_fusion_attention_grad"]


def npu_fusion_attention_grad(
    query,
    key,
    value,
    dy,
    head_num,
    input_layout,
    *,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    softmax_max=None,
    softmax_sum=None,
    softmax_in=None,
    attention_in=None,
    scale_value=1.0,
    keep_prob=1.0,
    pre_tockens=2147483647,
    next_tockens=2147483647,
    inner_precise=0,
    seed=0,
    offset=0,
    numels=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
):
    """Gradients of one ``npu_fusion_attention`` call given ``dy``, the forward's arguments as
    given to it; ``softmax_max``/``softmax_sum`` (both or neither) float32 ``[B, Nq, Sq, 8]`` (TND
    ``[Tq, Nq, 8]``); ``softmax_in``, ``seed``, ``offset``, ``numels`` ignored. Returns
    ``(dq, dk, dv, dpse)`` shaped like query/key/value and pse (empty without pse)."""
    args = (query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale_value)
    args += (keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen)
    args += (actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync)
    problem = validate_call(*args, kernel="reference")
    _check_grad_inputs(problem, query, dy, softmax_max, softmax_sum, attention_in, keep_prob)
    options = AttentionOptions(
        pse, atten_mask, float(scale_value), 1.0, pre_tockens, next_tockens, prefix, sparse_mode
    )
    if attention_in is None:
        with torch.no_grad():
            attention_in = run_reference(problem, query, key, value, options, False)[0]
    inputs = (problem, query, key, value, dy, attention_in, softmax_max, softmax_sum, options)
    if problem.layout == "TND":
        return (*_grad_packed(*inputs), query.new_empty(0))
    return _grad_dense(*inputs)


def _check_grad_inputs(problem, query, dy, softmax_max, softmax_sum, attention_in, keep_prob):
    out_shape = _output_shape(problem)
    for name, t in (("dy", dy), ("attention_in", attention_in)):
        if t is None and name == "attention_in":
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != out_shape:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            message = f"npu_fusion_attention_grad: {name}: expected the forward output's shape "
            message += f"{list(out_shape)} ({problem.layout}), got {got}\n"
            message += "  fix: pass the output (gradient) of the forward call of the same block"
            raise ValueError(message)
    if (softmax_max is None) != (softmax_sum is None):
        given = "softmax_max" if softmax_sum is None else "softmax_sum"
        message = "npu_fusion_attention_grad: softmax_max / softmax_sum: pass both or neither, "
        message += f"got {given} only\n  fix: pass outputs 1 and 2 of the forward call together"
        raise ValueError(message)
    stats_shape = _stats_shape(problem)
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != stats_shape):
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            message = f"npu_fusion_attention_grad: {name}: expected float32 {list(stats_shape)} "
            message += f"(the forward's statistics), got {got}\n"
            message += "  fix: pass outputs 1 and 2 of the forward call unchanged"
            raise ValueError(message)
    if float(keep_prob) != 1.0:
        message = (
            f"npu_fusion_attention_grad: keep_prob: the reference needs 1.0, got {keep_prob}; "
        )
        message += "it cannot replay the NPU's dropout stream\n"
        message += "  fix: use attention_dropout = 0 on CPU, or the torch_npu kernel on an NPU"
        raise NotImplementedError(message)


def _output_shape(problem) -> tuple[int, ...]:
    b, n, sq, dv = problem.batch, problem.heads_q, problem.seq_q, problem.head_dim_v
    shapes = {"BSH": (b, sq, n * dv), "SBH": (sq, b, n * dv), "BSND": (b, sq, n, dv)}
    shapes.update(BNSD=(b, n, sq, dv), TND=(sq, n, dv))
    return shapes[problem.layout]


def _stats_shape(problem) -> tuple[int, ...]:
    if problem.layout == "TND":
        return (problem.seq_q, problem.heads_q, 8)
    return (problem.batch, problem.heads_q, problem.seq_q, 8)


def _grad_dense(problem, query, key, value, dy, out, smax, ssum, options):
    """BSH/SBH/BSND/BNSD: one block of ``[B, N, S, D]`` tensors, the gradients written straight
    into buffers of the inputs' layouts when the inputs already have the compute dtype."""
    layout = problem.layout
    q = _to_bnsd(query, layout, problem.heads_q)
    k, v = (_to_bnsd(t, layout, problem.heads_kv) for t in (key, value))
    g, o = (_to_bnsd(t, layout, problem.heads_q) for t in (dy, out))
    dense_keep = None
    if options.atten_mask is not None and options.sparse_mode in (0, 1):
        dense_keep = torch.logical_not(options.atten_mask)  # True = kept
    keep = _plan(options, problem.seq_q, problem.seq_kv, dense_keep, options.prefix, q.device)
    lse = None if smax is None else _lse(smax[..., 0], ssum[..., 0])  # [B, Nq, Sq]
    targets = None
    if all(t.dtype == _compute_dtype(query) for t in (query, key, value)):
        grads = torch.empty_like(query), torch.zeros_like(key), torch.zeros_like(value)
        heads = (problem.heads_q, problem.heads_kv, problem.heads_kv)
        targets = [_to_bnsd(t, layout, n) for t, n in zip(grads, heads)]
    with torch.no_grad():
        dq, dk, dv, dpse = _block_grad(
            q, k, v, g, o, lse, keep, options.scale, options.pse, targets
        )
    dpse = query.new_empty(0) if dpse is None else dpse.to(options.pse.dtype)
    if targets is not None:
        return (*grads, dpse)
    return (
        _from_bnsd(dq.to(query.dtype), layout),
        _from_bnsd(dk.to(key.dtype), layout),
        _from_bnsd(dv.to(value.dtype), layout),
        dpse,
    )


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _lse(smax: torch.Tensor, ssum: torch.Tensor) -> torch.Tensor:
    """``max + log(sum)``; invalid rows (float32 min / max) give -inf, hence P = 0."""
    lse = smax.double() + torch.log(ssum.double())
    return lse.masked_fill(smax <= torch.finfo(torch.float32).min, float("inf"))


def _block_grad(q, k, v, g, o, lse, keep: _Keep, scale, pse, targets=None):
    """``(dq, dk, dv, dpse)`` of one ``[B, N, S, D]`` block in the compute dtype, in tiles of query
    rows x keys: q, g, o ``[B, Nq, Sq, D|Dv]``; k, v ``[B, Nkv, Skv, D|Dv]``; lse ``[B, Nq, Sq]``
    (+inf on invalid rows) or None; ``targets`` ``[dq, dk, dv]`` to write into (dk, dv zero)."""
    compute = _compute_dtype(q)
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    kc, vc = k.to(compute), v.to(compute)  # [B, Nkv, Skv, D|Dv]
    lse = None if lse is None else lse.to(compute)
    if targets is None:
        targets = [
            torch.empty(batch, heads_q, seq_q, head_dim, dtype=compute, device=q.device),
            torch.zeros(batch, heads_kv, seq_kv, head_dim, dtype=compute, device=q.device),
            torch.zeros(batch, heads_kv, seq_kv, v.shape[-1], dtype=compute, device=q.device),
        ]
    dq, dk, dv = targets
    dpse = None if pse is None else torch.zeros(pse.shape, dtype=compute, device=q.device)
    tiles = _Tiles(keep, seq_q, seq_kv, torch.finfo(compute).bits // 8 * batch * heads_q)
    for start, stop in tiles.row_blocks():

        def grouped(t, start=start, stop=stop):  # [B, Nq, r, X] -> [B, Nkv, G, r, X]
            return t[:, :, start:stop].to(compute).reshape(batch, heads_kv, group, stop - start, -1)

        q_r, g_r = grouped(q), grouped(g)
        delta = (g_r * grouped(o)).sum(-1, keepdim=True)  # [B, Nkv, G, r, 1]
        keep_rows = keep.rows(start, stop, seq_kv, q.device)  # [.., r, Skv] or None (all kept)
        if lse is None:
            lse_r = _rows_lse(q_r, kc, keep_rows, scale, pse, tiles, (start, stop))
        else:
            lse_r = lse[:, :, start:stop].reshape(batch, heads_kv, group, stop - start, 1)
        dq_r = torch.zeros_like(q_r)  # [B, Nkv, G, r, D]
        for k0, k1, mask in tiles.key_blocks(start, stop, keep_rows):
            span = (start, stop, k0, k1)
            prob = _probabilities(q_r, kc[:, :, k0:k1], lse_r, mask, scale, pse, span)
            # dK, dV sum over the group's query heads and the rows in one GEMM each (G*r inner
            # dimension), so no [B, Nkv, G, keys, D] partial is materialised
            dv[:, :, k0:k1] += torch.matmul(prob.flatten(2, 3).mT, g_r.flatten(2, 3))
            dscore = _grouped_matmul(g_r, vc[:, :, k0:k1].mT).sub_(delta).mul_(prob)
            del prob
            dq_r += _grouped_matmul(dscore, kc[:, :, k0:k1])
            dk_tile = torch.matmul(dscore.flatten(2, 3).mT, q_r.flatten(2, 3))
            dk[:, :, k0:k1].add_(dk_tile, alpha=scale)
            if dpse is not None:
                _add_dpse(dpse, scale * dscore.flatten(1, 2), pse, span)
        dq[:, :, start:stop] = dq_r.mul_(scale).flatten(1, 2)
    return dq, dk, dv, dpse


class _Tiles:
    """The tiles of one gradient block: row blocks of at most ``GRAD_BLOCK_BYTES`` of scores
    over ``KEY_BLOCK`` keys, and per row block the key blocks with their keep masks."""

    def __init__(self, keep: _Keep, seq_q: int, seq_kv: int, row_bytes: int) -> None:
        self.keep, self.seq_q, self.seq_kv = keep, seq_q, seq_kv
        self.keys = max(1, min(seq_kv, KEY_BLOCK))
        self.rows = max(1, GRAD_BLOCK_BYTES // max(1, row_bytes * self.keys))

    def row_blocks(self):
        for start in range(0, self.seq_q, self.rows):
            yield start, min(self.seq_q, start + self.rows)

    def key_blocks(self, start: int, stop: int, keep_rows):
        """``(k0, k1, mask)`` per key block of rows ``start:stop``: ``mask`` the keep mask
        ``[.., r, k1 - k0]`` (True = kept), None where every pair is kept; a block of a causal
        plan that keeps nothing is left out (its probabilities are 0)."""
        causal = self.keep.causal and self.keep.mask is None
        for k0 in range(0, self.seq_kv, self.keys):
            k1 = min(self.seq_kv, k0 + self.keys)
            if causal and k0 > stop - 1 + self.keep.offset:
                return  # this block and the later ones lie above the diagonal
            if keep_rows is None or (causal and k1 - 1 <= start + self.keep.offset):
                yield k0, k1, None  # below the diagonal: all kept
            else:
                yield k0, k1, keep_rows[..., k0:k1]


def _rows_lse(q_r, kc, keep_rows, scale, pse, tiles: _Tiles, rows) -> torch.Tensor:
    """The log-sum-exp ``[B, Nkv, G, r, 1]`` of query rows ``rows``, over the key blocks
    (+inf on rows that keep no key, so that their probabilities are 0)."""
    start, stop = rows
    lse = q_r.new_full((*q_r.shape[:-1], 1), float("-inf"))
    for k0, k1, mask in tiles.key_blocks(start, stop, keep_rows):
        scores = _scores(q_r, kc[:, :, k0:k1], mask, scale, pse, (start, stop, k0, k1))
        lse = torch.logaddexp(lse, torch.logsumexp(scores, -1, keepdim=True))
    return lse.masked_fill(torch.isneginf(lse), float("inf"))


def _scores(q_r, kc, mask, scale, pse, span):
    """``scale * (Q K^T + pse)`` of one tile, masked with -inf, ``[B, Nkv, G, r, keys]`` (q_r
    ``[B, Nkv, G, r, D]``, kc ``[B, Nkv, keys, D]``, span ``(start, stop, k0, k1)``)."""
    heads_kv, group = q_r.shape[1:3]
    start, stop, k0, k1 = span
    scores = _grouped_matmul(q_r, kc.mT)
    if pse is not None:
        bias = pse[..., start:stop, k0:k1] if pse.shape[-2] != 1 else pse[..., k0:k1]
        grouped = (bias.shape[0], heads_kv, group, bias.shape[-2], k1 - k0)
        scores += bias.to(scores.dtype).reshape(grouped)
    scores.mul_(scale)
    if mask is not None:
        scores.masked_fill_(~_grouped_mask(mask, heads_kv, group), float("-inf"))
    return scores


def _probabilities(q_r, kc, lse_r, mask, scale, pse, span):
    """``P = exp(scale * (Q K^T + pse) - lse)`` of one tile, masked, in one buffer
    ``[B, Nkv, G, r, keys]`` (``lse_r`` ``[B, Nkv, G, r, 1]``)."""
    return _scores(q_r, kc, mask, scale, pse, span).sub_(lse_r).exp_()


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [B, Nkv, G, r, X] @ b [B, Nkv, X, Y] -> [B, Nkv, G, r, Y]``: one GEMM per KV head over
    ``G*r`` rows (``torch.matmul`` would copy a broadcast ``b`` G times first)."""
    return torch.matmul(a.flatten(2, 3), b).unflatten(2, a.shape[2:4])


def _add_dpse(dpse, contribution, pse, span) -> None:
    """Add ``[B, Nq, r, keys]`` score gradients of the tile ``span = (start, stop, k0, k1)`` to
    ``dpse`` (pse's shape)."""
    start, stop, k0, k1 = span
    if pse.shape[0] == 1:
        contribution = contribution.sum(0, keepdim=True)
    if pse.shape[-2] == 1:
        dpse[..., k0:k1] += contribution.sum(-2, keepdim=True)
        return
    dpse[..., start:stop, k0:k1] += contribution


def _grouped_mask(keep_rows: torch.Tensor, heads_kv: int, group: int) -> torch.Tensor:
    """A keep mask broadcastable to ``[B, Nq, r, Skv]`` -> to ``[B, Nkv, G, r, Skv]``."""
    if keep_rows.dim() < 4:
        keep_rows = keep_rows.reshape((1,) * (4 - keep_rows.dim()) + tuple(keep_rows.shape))
    b, n = keep_rows.shape[:2]
    if n == 1:
        return keep_rows.unsqueeze(2)  # [B, 1, 1, r, Skv]
    return keep_rows.reshape(b, heads_kv, group, *keep_rows.shape[2:])


def _grad_packed(problem, query, key, value, dy, out, smax, ssum, options):
    """TND: segment by segment; statistics are N-major per segment (as the forward fills them)."""
    heads_q = problem.heads_q
    band_segment = None
    if options.sparse_mode in (7, 8):
        band_segment = split_q_band_segment(problem, options.sparse_mode)
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    bounds = zip(
        problem.segments_q, problem.segments_q[1:], problem.segments_kv, problem.segments_kv[1:]
    )
    for s, (q0, q1, k0, k1) in enumerate(bounds):
        seq_q, seq_kv = q1 - q0, k1 - k0
        if seq_q == 0 or seq_kv == 0:
            continue
        stats = slice(q0 * heads_q * 8, q1 * heads_q * 8)
        lse = None
        if smax is not None:
            seg_max = smax.reshape(-1)[stats].view(1, heads_q, seq_q, 8)[..., 0]
            seg_sum = ssum.reshape(-1)[stats].view(1, heads_q, seq_q, 8)[..., 0]
            lse = _lse(seg_max, seg_sum)
        keep = _segment_plan(options, s, seq_q, seq_kv, band_segment, query.device)
        q, k, v = _segment(query, q0, q1), _segment(key, k0, k1), _segment(value, k0, k1)
        g, o = _segment(dy, q0, q1), _segment(out, q0, q1)
        grads = _block_grad(q, k, v, g, o, lse, keep, options.scale, None)
        spans = ((q0, q1), (k0, k1), (k0, k1))
        for target, grad, (a, b) in zip((dq, dk, dv), grads, spans):
            target[a:b] += grad[0].transpose(0, 1).to(target.dtype)  # [1, N, S_s, X] -> [S_s, N, X]
    return dq, dk, dv
