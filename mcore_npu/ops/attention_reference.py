"""A pure-PyTorch reference of ``torch_npu.npu_fusion_attention`` (also importable from
:mod:`mcore_npu.ops.reference`): the operator's signature (``pre_tockens`` included), defaults,
mask polarity (``atten_mask`` True = masked out), 7-tuple return and refusals
(:func:`mcore_npu.ops.validation.validate_call`), plus float64 for ``gradcheck`` and oracles.

No path builds a ``[B, N, Sq, Skv]`` float score tensor and GQA never repeats K/V. Rows without
a kept key give output 0, ``softmax_max`` = float32 min, ``softmax_sum`` = float32 max, zero
gradients. The paths and their memory: docs/ops.md, "The attention reference"."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mcore_npu.ops import contract as C
from mcore_npu.ops.blocked_attention import attention_with_statistics
from mcore_npu.ops.contract import AttentionProblem
from mcore_npu.ops.sparse_modes import band_covers_everything, band_keep, causal_keep, prefix_keep
from mcore_npu.ops.validation import split_q_band_segment, validate_call

STATS_CHUNK_BYTES = 4 * 2**20
"""Largest float32 score block materialised while computing softmax statistics."""

_F32 = torch.finfo(torch.float32)


def npu_fusion_attention(
    query,
    key,
    value,
    head_num,
    input_layout,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    scale=1.0,
    keep_prob=1.0,
    pre_tockens=2147483647,
    next_tockens=2147483647,
    inner_precise=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
):
    """``Dropout(Softmax(Mask(scale * (pse + Q @ K^T), atten_mask)), keep_prob) @ V``.

    Arguments and layouts as the operator's (specs/npu_fusion_attention.md): ``atten_mask``
    True = masked out, ``scale`` 1.0 by default (not 1/sqrt(D)). Returns ``(out, softmax_max,
    softmax_sum, softmax_out, seed, offset, numels)``: out in the query's layout and dtype with D
    replaced by Dv; the statistics float32 ``[B, Nq, Sq, 8]`` (TND ``[Tq, Nq, 8]``, N-major per
    segment), detached; ``softmax_out`` empty; seed and offset 0 (dropout is PyTorch's)."""
    first = (pse, atten_mask, float(scale), float(keep_prob))
    options = AttentionOptions(*first, pre_tockens, next_tockens, prefix, sparse_mode)
    args = (query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale)
    args += (keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen)
    args += (actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync)
    problem = validate_call(*args, kernel="reference")
    out, softmax_max, softmax_sum = run_reference(problem, query, key, value, options, True)
    empty = query.new_empty(0)
    return out, softmax_max, softmax_sum, empty, 0, 0, problem.dropout_mask_numel()


@dataclass(frozen=True)
class AttentionOptions:
    """The operator arguments that shape the math (validated before they get here)."""

    pse: torch.Tensor | None = None
    atten_mask: torch.Tensor | None = None  # True = masked out
    scale: float = 1.0
    keep_prob: float = 1.0
    pre_tokens: int = C.INT32_MAX
    next_tokens: int = C.INT32_MAX
    prefix: tuple[int, ...] | list[int] | None = None
    sparse_mode: int = 0


@dataclass(frozen=True)
class _Keep:
    """Which scores one attention block keeps (True = kept, SDPA's polarity): all (neither
    ``causal`` nor ``mask``); ``causal``: row i keeps keys ``j <= i + offset`` (0: top-left,
    ``Skv - Sq > 0``: a wide block's bottom-right); or the keep ``mask`` (broadcastable to
    ``[B, N, Sq, Skv]``)."""

    causal: bool = False
    mask: torch.Tensor | None = None
    offset: int = 0

    def rows(self, start: int, stop: int, seq_kv: int, device) -> torch.Tensor | None:
        """The keep mask of query rows ``start:stop`` (``[.., rows, Skv]``), or None if full."""
        if self.mask is not None:
            return self.mask[..., start:stop, :]
        if self.causal:
            offset, rows = self.offset, (start, stop)
            return band_keep(stop, seq_kv, C.INT32_MAX, 0, offset=offset, rows=rows, device=device)
        return None

    def dense(self, seq_q: int, seq_kv: int, device) -> torch.Tensor | None:
        return self.rows(0, seq_q, seq_kv, device)


def run_reference(
    problem: AttentionProblem,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    options: AttentionOptions,
    need_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Attention for a validated call: ``(out, softmax_max, softmax_sum)``, the statistics
    None unless ``need_stats``."""
    if problem.layout == "TND":
        return _run_packed(problem, query, key, value, options, need_stats)
    q, k, v = (_to_bnsd(t, problem.layout, n) for t, n in _with_heads(problem, query, key, value))
    dense_keep = None
    if options.atten_mask is not None and options.sparse_mode in (0, 1):
        dense_keep = torch.logical_not(options.atten_mask)  # True = kept
    keep = _plan(options, problem.seq_q, problem.seq_kv, dense_keep, options.prefix, q.device)
    out, smax, ssum = _attend(q, k, v, keep, options, options.pse, need_stats)
    return _from_bnsd(out, problem.layout), smax, ssum


def _with_heads(problem, query, key, value):
    return ((query, problem.heads_q), (key, problem.heads_kv), (value, problem.heads_kv))


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """Any non-TND layout -> ``[B, N, S, D]`` (a view where strides allow)."""
    if layout == "BSH":  # [B, S, N*D] -> [B, S, N, D] -> [B, N, S, D]
        return t.unflatten(-1, (heads, -1)).transpose(1, 2)
    if layout == "SBH":  # [S, B, N*D] -> [S, B, N, D] -> [B, N, S, D]
        return t.unflatten(-1, (heads, -1)).permute(1, 2, 0, 3)
    if layout == "BSND":  # [B, S, N, D] -> [B, N, S, D]
        return t.transpose(1, 2)
    return t  # BNSD


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``[B, N, S, Dv]`` -> the query's layout (contiguous)."""
    if layout == "BSH":  # [B, N, S, Dv] -> [B, S, N*Dv]
        return t.transpose(1, 2).flatten(2)
    if layout == "SBH":  # [B, N, S, Dv] -> [S, B, N*Dv]
        return t.permute(2, 0, 1, 3).flatten(2)
    if layout == "BSND":  # [B, N, S, Dv] -> [B, S, N, Dv]
        return t.transpose(1, 2).contiguous()
    return t.contiguous()


def _plan(options, seq_q, seq_kv, dense_keep, prefix, device, mode=None) -> _Keep:
    """The keep condition of ``mode`` (default: options.sparse_mode) for one Sq x Skv block."""
    mode = options.sparse_mode if mode is None else mode
    pre, nxt, offset = options.pre_tokens, options.next_tokens, seq_kv - seq_q
    if mode in (0, 1):
        if dense_keep is None:
            return _Keep()  # no atten_mask: full attention, pre/next ignored (as the operator)
        if mode == 0 and not band_covers_everything(seq_q, seq_kv, pre, nxt, 0):
            return _Keep(mask=dense_keep & band_keep(seq_q, seq_kv, pre, nxt, device=device))
        return _Keep(mask=dense_keep)
    if mode == 2 or (mode == 3 and offset == 0):
        return _Keep(causal=True)
    if mode == 3 and offset > 0:  # wide block: every row keeps at least one key
        return _Keep(causal=True, offset=offset)
    if mode == 3:
        return _Keep(mask=causal_keep(seq_q, seq_kv, bottom_right=True, device=device))
    if mode == 4:
        if band_covers_everything(seq_q, seq_kv, pre, nxt, offset):
            return _Keep()
        if offset == 0 and nxt == 0 and band_covers_everything(seq_q, seq_kv, pre, seq_kv, 0):
            return _Keep(causal=True)
        return _Keep(mask=band_keep(seq_q, seq_kv, pre, nxt, offset=offset, device=device))
    if mode in (5, 6):
        return _Keep(mask=prefix_keep(seq_q, seq_kv, prefix, device=device))
    raise AssertionError(f"mode {mode} is planned per segment")  # 7/8: see _run_packed


def _attend(q, k, v, keep: _Keep, options, pse, need_stats):
    """SDPA on ``[B, N, S, D]`` tensors with invalid rows zeroed: ``(out [B, Nq, Sq, Dv],
    softmax_max, softmax_sum)``, the statistics float32 ``[B, Nq, Sq, 8]`` or None."""
    seq_q, seq_kv = q.shape[-2], k.shape[-2]
    if seq_kv == 0:  # no key at all: every row is invalid
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        return (out, *_invalid_statistics(q)) if need_stats else (out, None, None)
    if keep.offset and pse is None:
        out = _attend_bottom_right(q, k, v, keep.offset, options)
        stats = _statistics(q, k, keep, options.scale, pse) if need_stats else (None, None)
        return (out, *stats)
    if need_stats and _blocked_statistics_apply(q, k, v, keep, options, pse):
        return attention_with_statistics(q, k, v, keep.causal, options.scale)
    if need_stats and _fast_statistics_apply(q, keep, options, pse):
        return _attend_with_statistics(q, k, v, keep, options.scale)
    mask = keep.mask
    if pse is not None and keep.causal:
        mask = keep.dense(seq_q, seq_kv, q.device)
    valid_rows = None
    if mask is not None:
        valid_rows = mask.any(-1, keepdim=True)  # [.., Sq, 1]
        if bool(valid_rows.all()):
            valid_rows = None
        else:  # let rows with no key attend everywhere (finite math), then zero them
            mask = mask | ~valid_rows
    attn_mask = mask
    if pse is not None:  # additive float: scale * pse, -inf where masked
        attn_mask = pse * options.scale
        if mask is not None:
            attn_mask = attn_mask.masked_fill(~mask, float("-inf"))
    out = _sdpa(q, k, v, options, attn_mask, keep.causal and pse is None)
    if valid_rows is not None:
        out = out.masked_fill(~valid_rows, 0.0)
    if not need_stats:
        return out, None, None
    return (out, *_statistics(q, k, keep, options.scale, pse))


def _sdpa(q, k, v, options, attn_mask=None, is_causal=False) -> torch.Tensor:
    """SDPA with the call's dropout and scale, GQA native."""
    dropout, gqa = 1.0 - options.keep_prob, q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask, dropout, is_causal, scale=options.scale, enable_gqa=gqa
    )


def _attend_bottom_right(q, k, v, offset: int, options) -> torch.Tensor:
    """Bottom-right causal attention of a wide block (``offset = Skv - Sq > 0``), no Sq x Skv mask:
    :class:`_BottomRightCausal` on the CPU without dropout, else SDPA's top-left causal over the
    queries preceded by ``offset`` zero rows whose outputs are dropped. -> ``[B, Nq, Sq, Dv]``."""
    if _BottomRightCausal.applies(q, v, options):
        return _BottomRightCausal.apply(q, k, v, offset, options.scale)
    padded = torch.cat([q.new_zeros(*q.shape[:2], offset, q.shape[-1]), q], dim=2)
    return _sdpa(padded, k, v, options, is_causal=True)[:, :, offset:]


class _BottomRightCausal(torch.autograd.Function):
    """Bottom-right causal attention of a wide block on the CPU, exact and unpadded: keys
    ``[0, offset)`` (seen by every row) in one full fused call, keys ``[offset, Skv)`` in one causal
    call, merged by their log-sum-exps (as ring attention merges blocks); each part's fused backward
    returns its share of the gradients. q ``[B, Nq, Sq, D]``, k/v ``[B, Nkv, Skv, D]``."""

    @staticmethod
    def applies(q, v, options) -> bool:
        """The fused CPU kernel's cases: CPU, no dropout, Dv == D > 0, at least one query."""
        return (
            q.device.type == "cpu"
            and options.keep_prob == 1.0
            and v.shape[-1] == q.shape[-1] > 0
            and q.shape[-2] > 0
        )

    @staticmethod
    def _parts(offset: int):
        """``(keys, causal)`` of the two parts."""
        return (slice(0, offset), False), (slice(offset, None), True)

    @staticmethod
    def forward(ctx, q, k, v, offset: int, scale: float):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        (out, lse_1), (out_2, lse_2) = (
            flash(q, k[:, :, keys], v[:, :, keys], 0.0, causal, scale=scale)
            for keys, causal in _BottomRightCausal._parts(offset)
        )
        lse = torch.logaddexp(lse_1, lse_2)  # [B, Nq, Sq]
        out.mul_((lse_1 - lse).exp_().unsqueeze(-1).to(out.dtype))
        out.add_(out_2.mul_((lse_2 - lse).exp_().unsqueeze(-1).to(out.dtype)))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.offset, ctx.scale = offset, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq, dk, dv = None, torch.empty_like(k), torch.empty_like(v)
        for keys, causal in _BottomRightCausal._parts(ctx.offset):
            dq_p, dk[:, :, keys], dv[:, :, keys] = backward(
                dout, q, k[:, :, keys], v[:, :, keys], out, lse, 0.0, causal, scale=ctx.scale
            )
            dq = dq_p if dq is None else dq.add_(dq_p)
        return dq, dk, dv, None, None


def _blocked_statistics_apply(q, k, v, keep: _Keep, options, pse) -> bool:
    """The one-pass blocked kernel: full or causal, no bias, no dropout, nothing for autograd."""
    records_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return (
        not records_grad
        and keep.mask is None
        and keep.offset == 0
        and pse is None
        and options.keep_prob == 1.0
        and q.shape[-1] > 0
    )


def _fast_statistics_apply(q, keep: _Keep, options, pse) -> bool:
    """The fused CPU kernel returns the log-sum-exp: full or causal, no bias, no dropout
    (reached when autograd records the call: the blocked kernel has no backward)."""
    return (
        q.device.type == "cpu"
        and keep.mask is None
        and keep.offset == 0
        and pse is None
        and options.keep_prob == 1.0
        and options.scale > 0
        and q.shape[-1] > 0
    )


def _attend_with_statistics(q, k, v, keep: _Keep, scale):
    """Full and causal blocks with statistics: the CPU flash kernel's output and log-sum-exp
    (with autograd), the row max from :func:`_row_max`, ``softmax_sum = exp(lse - max)``."""
    if v.shape[-1] != q.shape[-1]:  # the fused kernel wants Dv == D
        return (*_attend_plain(q, k, v, keep, scale), *_statistics(q, k, keep, scale, None))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, k, v, 0.0, keep.causal, scale=scale)  # lse [B, Nq, Sq]
    with torch.no_grad():
        row_max = _row_max(q, k, keep.causal, scale)  # [B, Nq, Sq]
        row_sum = torch.exp(lse.detach().float() - row_max)
    expand = (*row_max.shape, 8)
    return (
        out,
        row_max.unsqueeze(-1).expand(expand).contiguous(),
        row_sum.unsqueeze(-1).expand(expand).contiguous(),
    )


def _attend_plain(q, k, v, keep, scale):
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=keep.causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return (out,)


ROW_MAX_ROWS = 128
"""Query rows per block of the row-max pass (with as many heads as fit ``ROW_MAX_BYTES``)."""
ROW_MAX_BYTES = 4 * 2**20
"""Largest float32 score block of the row-max pass: small enough to stay in cache."""


def _row_max(q, k, causal: bool, scale: float) -> torch.Tensor:
    """``max_j scale * q_i . k_j`` over the kept keys (top-left causal or all), float32
    ``[B, Nq, Sq]``; the scale is applied to the max (exact for scale > 0)."""
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.reshape(batch * heads_kv, group, seq_q, head_dim).to(compute)  # [B*Nkv, G, Sq, D]
    kg = k.reshape(batch * heads_kv, seq_kv, head_dim).to(compute)  # [B*Nkv, Skv, D]
    out = torch.empty(batch * heads_kv, group, seq_q, dtype=compute, device=q.device)
    rows = min(ROW_MAX_ROWS, max(seq_q, 1))
    per_row = max(1, group * rows * seq_kv * 4)
    heads = max(1, min(batch * heads_kv, ROW_MAX_BYTES // per_row))
    for h in range(0, batch * heads_kv, heads):
        for start in range(0, seq_q, rows):
            stop = min(seq_q, start + rows)
            keys = min(stop, seq_kv) if causal else seq_kv
            if keys == 0:
                out[h : h + heads, :, start:stop] = float("-inf")
                continue
            q_block = qg[h : h + heads, :, start:stop]  # [h, G, r, D]
            hb = q_block.shape[0]
            # one batched GEMM per kv head: [h, G*r, D] @ [h, D, keys] (3-D bmm, no broadcast)
            scores = torch.bmm(q_block.reshape(hb, -1, head_dim), kg[h : h + heads, :keys].mT)
            scores = scores.view(hb, group, stop - start, keys)
            if causal and start < keys:  # the diagonal square [start:stop, start:keys]
                tri = torch.ones(stop - start, keys - start, dtype=torch.bool, device=q.device)
                scores[..., start:keys].masked_fill_(tri.triu_(1), float("-inf"))
            torch.amax(scores, -1, out=out[h : h + heads, :, start:stop])
    out = out.view(batch, heads_q, seq_q).mul_(scale).float()
    valid = torch.isfinite(out)
    return torch.where(valid, out, _F32.min)


def _invalid_statistics(q):
    """Statistics of rows without any key: float32 min / float32 max, ``[B, Nq, Sq, 8]``."""
    shape = (*q.shape[:-1], 8)
    return (
        torch.full(shape, _F32.min, device=q.device),
        torch.full(shape, _F32.max, device=q.device),
    )


@torch.no_grad()
def _statistics(q, k, keep: _Keep, scale, pse):
    """Row max and row sum of ``exp(score - max)`` of the scaled, masked scores, chunked by
    rows: float32 ``[B, Nq, Sq, 8]`` each (repeated 8 times, as the operator stores them);
    invalid rows float32 min / float32 max."""
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[-2]
    group = heads_q // heads_kv
    qg = q.float().reshape(batch, heads_kv, group, seq_q, head_dim)  # [B, Nkv, G, Sq, D]
    kt = k.float().unsqueeze(2).transpose(-1, -2)  # [B, Nkv, 1, D, Skv]
    step = max(1, STATS_CHUNK_BYTES // max(1, 4 * batch * heads_q * seq_kv))
    maxes, sums = [], []
    for start in range(0, seq_q, step):
        stop = min(seq_q, start + step)
        scores = torch.matmul(qg[..., start:stop, :], kt).flatten(1, 2)  # [B, Nq, rows, Skv]
        if pse is not None:
            scores += pse[..., start:stop, :] if pse.shape[-2] != 1 else pse
        scores *= scale
        keep_rows = keep.rows(start, stop, seq_kv, q.device)
        if keep_rows is not None:
            scores.masked_fill_(~keep_rows, float("-inf"))
        row_max = scores.amax(-1)  # [B, Nq, rows]
        valid = torch.isfinite(row_max)
        shifted = scores - torch.where(valid, row_max, 0.0).unsqueeze(-1)
        row_sum = shifted.exp_().sum(-1)
        maxes.append(torch.where(valid, row_max, _F32.min))
        sums.append(torch.where(valid, row_sum, _F32.max))
    if not maxes:  # Sq == 0
        empty = q.new_zeros((batch, heads_q, 0), dtype=torch.float32)
        maxes, sums = [empty], [empty]
    expand = (batch, heads_q, seq_q, 8)
    return (
        torch.cat(maxes, -1).unsqueeze(-1).expand(expand).contiguous(),
        torch.cat(sums, -1).unsqueeze(-1).expand(expand).contiguous(),
    )


def _run_packed(problem, query, key, value, options, need_stats):
    """TND: each (q segment, kv segment) pair is an independent attention."""
    heads, head_dim_v = problem.heads_q, problem.head_dim_v
    band_segment = None
    if options.sparse_mode in (7, 8):
        band_segment = split_q_band_segment(problem, options.sparse_mode)
    outs, maxes, sums = [], [], []
    bounds = zip(
        problem.segments_q, problem.segments_q[1:], problem.segments_kv, problem.segments_kv[1:]
    )
    for s, (q0, q1, k0, k1) in enumerate(bounds):
        seq_q, seq_kv = q1 - q0, k1 - k0
        if seq_q == 0:
            continue
        if seq_kv == 0:  # every row invalid: output 0
            outs.append(query.new_zeros(seq_q, heads, head_dim_v))
            if need_stats:
                maxes.append(torch.full((heads * seq_q * 8,), _F32.min, device=query.device))
                sums.append(torch.full((heads * seq_q * 8,), _F32.max, device=query.device))
            continue
        q, k, v = _segment(query, q0, q1), _segment(key, k0, k1), _segment(value, k0, k1)
        keep = _segment_plan(options, s, seq_q, seq_kv, band_segment, query.device)
        out, smax, ssum = _attend(q, k, v, keep, options, None, need_stats)
        outs.append(out[0].transpose(0, 1))  # [1, N, S_s, Dv] -> [S_s, N, Dv]
        if need_stats:  # the operator fills TND statistics segment by segment, N-major
            maxes.append(smax.reshape(-1))
            sums.append(ssum.reshape(-1))
    out = torch.cat(outs) if outs else query.new_zeros(0, heads, head_dim_v)
    if not need_stats:
        return out, None, None
    stats_shape = (problem.seq_q, heads, 8)
    smax = torch.cat(maxes).view(stats_shape) if maxes else query.new_zeros(stats_shape).float()
    ssum = torch.cat(sums).view(stats_shape) if sums else query.new_zeros(stats_shape).float()
    return out, smax, ssum


def _segment(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """TND ``[T, N, D]`` rows ``start:stop`` -> ``[1, N, S_s, D]``."""
    return t[start:stop].transpose(0, 1).unsqueeze(0)


def _segment_plan(options, s, seq_q, seq_kv, band_segment, device) -> _Keep:
    mode = options.sparse_mode
    if mode in (7, 8):
        mode = 4 if s == band_segment else (3 if mode == 7 else 2)
    dense_keep = None
    if options.atten_mask is not None and mode in (0, 1):
        # The 2-D [maxSq, maxSkv] mask applies to each segment from its top-left corner.
        dense_keep = torch.logical_not(options.atten_mask[:seq_q, :seq_kv])
        if not bool(dense_keep.any(-1).all()):
            message = f"npu_fusion_attention: atten_mask: segment {s} ({seq_q} x {seq_kv}) has a "
            message += "fully masked query row; TND masks must not contain padding rows\n  fix: "
            message += (
                "drop padded tokens from the packed batch (mcore_npu.masks.padding_to_packed)"
            )
            raise ValueError(message)
    prefix = None if options.prefix is None else [options.prefix[s]]
    return _plan(options, seq_q, seq_kv, dense_keep, prefix, device, mode=mode)
