"""A pure-PyTorch reference of ``torch_npu.npu_fusion_attention`` (its torch_npu name, with
every other operator's reference, is in :mod:`mcore_npu.ops.reference`).

Same signature (spelling included: ``pre_tockens``), defaults, mask polarity (``atten_mask``
True = masked out) and 7-tuple return as the Ascend operator, and the same refusals: every call
goes through :func:`mcore_npu.ops.validation.validate_call` first. The one extension is float64
inputs, which the real kernel refuses; the reference takes them so that ``gradcheck`` and float64
oracles can run.

Which path each sparse mode takes, and what it costs beyond q/k/v and the output
(B batch, N query heads, Sq/Skv sequence lengths)::

    mode / situation                        path                                extra memory
    no mask (modes 0/1), causal (2; 3 and   SDPA, no mask / is_causal           none (fused CPU
      4 when they reduce to it)                                                  kernel: O(block))
    3 with Sq != Skv, 4, 5, 6               SDPA + one bool keep mask           Sq*Skv bytes (B*Sq*Skv
                                                                                 for 5/6), plus SDPA's
                                                                                 own float copy of it
    0 / 1 with a dense mask                 SDPA + the negated mask             one bool copy of it
    any mode with pse                       SDPA + additive float bias          the bias' size, float
    TND (packed)                            the above, segment by segment       per-segment sizes

No path builds a [B, N, Sq, Skv] float score tensor, except the one the ``pse`` bias itself is.
GQA never repeats K/V: SDPA runs with ``enable_gqa`` (query head i reads kv head i // (Nq/Nkv)).
Measured, not assumed: on the CPU by ``mcore-npu bench attention``; on an H200 (torch 2.11,
``benchmarks/cuda_reference_memory.py``, results in ``docs/cuda/``) a causal GQA call (32 query
/ 8 kv heads, bf16, S = 8192) allocated exactly what a bare SDPA call does, the output plus 1.5 KiB.
Rows whose every key is masked ("invalid rows") give output 0, ``softmax_max`` = float32 min,
``softmax_sum`` = float32 max, and zero gradients.

The softmax statistics (outputs 1 and 2) are returned detached. Full and causal attention
without ``pse`` or dropout compute output and statistics together in one blocked pass
(:mod:`mcore_npu.ops.blocked_attention`: the flops of one fused call, score buffers of at most
``BLOCK_BYTES`` beyond the results), unless autograd records the call: then the fused CPU kernel
gives the output (differentiable) and the log-sum-exp, and a blocked row-max pass the max. Every
other case runs SDPA and computes the statistics in row chunks of at most ``STATS_CHUNK_BYTES``
of scores. :func:`mcore_npu.ops.fusion_attention`, which returns the output only, skips them.

Dropout (``keep_prob < 1``) is ordinary PyTorch dropout, not the NPU's Philox stream; outputs 4
and 5 (seed, offset) are returned as 0.
"""

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

    Args:
        query: BSH ``[B, Sq, Nq*D]``, SBH ``[Sq, B, Nq*D]``, BSND ``[B, Sq, Nq, D]``,
            BNSD ``[B, Nq, Sq, D]`` or TND ``[Tq, Nq, D]``.
        key, value: the same layout with Nkv heads and Skv (Tkv) positions; value may have Dv <= D.
        head_num: Nq, query heads on this rank.
        input_layout: one of ``"BSH", "SBH", "BSND", "BNSD", "TND"``.
        pse: additive bias added *before* scaling, ``[B|1, N, Sq|1, Skv]``.
        padding_mask: unsupported; must be None.
        atten_mask: bool/uint8, **True = masked out**. Dense forms for modes 0/1/5, the compressed
            ``[2048, 2048]`` mask for modes 2/3/4/7/8, ``[3072, 2048]`` for mode 6.
        scale: multiplies ``pse + Q @ K^T``. Default 1.0, not 1/sqrt(D).
        keep_prob: dropout keep probability in (0, 1].
        pre_tockens, next_tockens: band widths for modes 0 and 4 (and the band segment of 7/8).
        inner_precise: 0, 1 or 2; no numeric effect here (invalid rows are always handled).
        prefix: per-batch prefix lengths, modes 5/6.
        actual_seq_qlen, actual_seq_kvlen: TND only, cumulative END offsets without a leading 0.
        sparse_mode: 0..8, see ``specs/npu_fusion_attention.md``.
        gen_mask_parallel, sync: no numeric effect.

    Returns:
        tuple: ``(out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``: out in the
        query's layout and dtype with D replaced by Dv; the statistics float32
        ``[B, Nq, Sq, 8]`` (TND ``[Tq, Nq, 8]``, filled per segment in N-major order);
        ``softmax_out`` an empty tensor; seed and offset 0; numels the dropout-mask length.

    Example:
        >>> q = k = v = torch.randn(2, 5, 4 * 8)  # BSH, 4 heads of 8
        >>> from mcore_npu.masks import compressed_causal_mask
        >>> out = npu_fusion_attention(q, k, v, 4, "BSH", atten_mask=compressed_causal_mask(),
        ...                            scale=8**-0.5, sparse_mode=2)[0]
        >>> out.shape
        torch.Size([2, 5, 32])
    """
    options = AttentionOptions(
        pse, atten_mask, float(scale), float(keep_prob), pre_tockens, next_tockens, prefix,
        sparse_mode,
    )  # fmt: skip
    problem = validate_call(
        query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
        keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen,
        actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync, kernel="reference",
    )  # fmt: skip
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
    """Which scores one attention block keeps. Polarity: True = kept (SDPA's, not the op's).

    Neither ``causal`` nor ``mask``: full attention. ``causal``: causal attention, row i keeps
    keys ``j <= i + offset``: ``offset`` 0 is top-left (left to SDPA's ``is_causal``), ``offset
    = Skv - Sq > 0`` bottom-right (mode 3 of a wide block, computed without a mask). ``mask``: an
    explicit keep mask broadcastable to ``[B, N, Sq, Skv]``.
    """

    causal: bool = False
    mask: torch.Tensor | None = None
    offset: int = 0

    def rows(self, start: int, stop: int, seq_kv: int, device) -> torch.Tensor | None:
        """The keep mask of query rows ``start:stop`` (``[.., rows, Skv]``), or None if full."""
        if self.mask is not None:
            return self.mask[..., start:stop, :]
        if self.causal:
            return band_keep(stop, seq_kv, C.INT32_MAX, 0, offset=self.offset, rows=(start, stop),
                             device=device)  # fmt: skip
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
    """Attention for an already validated call: ``(out, softmax_max, softmax_sum)``.

    The statistics are None unless ``need_stats``.
    """
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
    """SDPA on ``[B, N, S, D]`` tensors with invalid rows zeroed; optional statistics.

    Returns:
        ``(out [B, Nq, Sq, Dv], softmax_max, softmax_sum)``, the statistics
        ``[B, Nq, Sq, 8]`` float32 or None.
    """
    seq_q, seq_kv = q.shape[-2], k.shape[-2]
    if seq_kv == 0:  # no key at all: every row is invalid
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        return (out, *_invalid_statistics(q)) if need_stats else (out, None, None)
    if keep.offset and pse is None:
        out = _attend_bottom_right(q, k, v, keep.offset, options)
        return (
            (out, *_statistics(q, k, keep, options.scale, pse)) if need_stats else (out, None, None)
        )
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
    out = F.scaled_dot_product_attention(
        q, k, v,
        attn_mask=attn_mask,
        dropout_p=1.0 - options.keep_prob,
        is_causal=keep.causal and pse is None,
        scale=options.scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    if valid_rows is not None:
        out = out.masked_fill(~valid_rows, 0.0)
    if not need_stats:
        return out, None, None
    return (out, *_statistics(q, k, keep, options.scale, pse))


def _attend_bottom_right(q, k, v, offset: int, options) -> torch.Tensor:
    """Bottom-right causal attention of a wide block (``offset = Skv - Sq > 0``: row i keeps keys
    ``j <= i + offset``) without an Sq x Skv mask (which SDPA would also expand to float).

    On the CPU without dropout: :class:`_BottomRightCausal` (two fused calls, nothing padded).
    Elsewhere: SDPA's top-left causal over the queries preceded by ``offset`` zero rows, whose
    outputs are dropped (the kept rows see exactly their keys; the dropped rows take no
    gradient), at the cost of ``[B, N, Skv, D]`` queries.

    q ``[B, Nq, Sq, D]``, k/v ``[B, Nkv, Skv, D|Dv]`` -> ``[B, Nq, Sq, Dv]``.
    """
    if _BottomRightCausal.applies(q, v, options):
        return _BottomRightCausal.apply(q, k, v, offset, options.scale)
    padded = torch.cat([q.new_zeros(*q.shape[:2], offset, q.shape[-1]), q], dim=2)
    out = F.scaled_dot_product_attention(
        padded, k, v,
        dropout_p=1.0 - options.keep_prob,
        is_causal=True,
        scale=options.scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    return out[:, :, offset:]


class _BottomRightCausal(torch.autograd.Function):
    """Bottom-right causal attention of a wide block on the CPU, exact and unpadded.

    Keys ``[0, offset)`` are seen by every row: one full fused call; keys ``[offset, Skv)`` form
    a top-left causal square: one causal fused call. PyTorch's CPU flash kernel returns each
    part's output and log-sum-exp (GQA native), and the parts merge as ring attention merges
    blocks: ``lse = logaddexp(lse_1, lse_2)``, ``out = sum_p out_p exp(lse_p - lse)``. The
    backward runs the fused backward of each part with the merged output and log-sum-exp,
    which returns exactly that part's share of dQ, dK and dV.

    q ``[B, Nq, Sq, D]``, k/v ``[B, Nkv, Skv, D]`` -> ``[B, Nq, Sq, D]``; saves q, k, v, the
    output and the log-sum-exp ``[B, Nq, Sq]``.
    """

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
    """The fused CPU kernel returns the log-sum-exp: full or causal, no bias, no dropout.

    Reached when autograd records the call (the blocked kernel has no backward).
    """
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
    """The statistics path for full and causal blocks: one fused call plus a row-max pass.

    PyTorch's CPU flash kernel returns the output and the log-sum-exp ``lse`` (GQA native, with
    autograd). The contract wants the max and the sum separately, so the row max is computed
    by :func:`_row_max` (matmul + amax, no exp, in small blocks) and the sum follows exactly:
    ``softmax_sum = exp(lse - softmax_max)``.
    """
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
    """``max_j scale * q_i . k_j`` over the kept keys (top-left causal or all), float32.

    The scale is applied to the max, not to every score: for scale > 0 rounding is monotonic, so
    ``max(fl(scale * x)) == fl(scale * max(x))`` exactly. Causal blocks multiply only the keys a
    row block can see (``:stop``) and mask the diagonal square.

    Args:
        q: ``[B, Nq, Sq, D]``; k: ``[B, Nkv, Skv, D]`` (Nq % Nkv == 0, head i reads i // G).

    Returns:
        ``[B, Nq, Sq]`` float32.
    """
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
    """Row max and row sum of ``exp(score - max)`` of the scaled, masked scores, chunked by rows.

    Returns:
        ``(softmax_max, softmax_sum)``, float32 ``[B, Nq, Sq, 8]`` each (the value repeated 8
        times, as the operator stores it). Invalid rows: float32 min / float32 max.
    """
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
        # [T, N, D] slice -> [1, N, S_s, D]
        q, k, v = (t[a:b].transpose(0, 1).unsqueeze(0) for t, a, b in
                   ((query, q0, q1), (key, k0, k1), (value, k0, k1)))  # fmt: skip
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


def _segment_plan(options, s, seq_q, seq_kv, band_segment, device) -> _Keep:
    mode = options.sparse_mode
    if mode in (7, 8):
        mode = 4 if s == band_segment else (3 if mode == 7 else 2)
    dense_keep = None
    if options.atten_mask is not None and mode in (0, 1):
        # The 2-D [maxSq, maxSkv] mask applies to each segment from its top-left corner.
        dense_keep = torch.logical_not(options.atten_mask[:seq_q, :seq_kv])
        if not bool(dense_keep.any(-1).all()):
            raise ValueError(
                f"npu_fusion_attention: atten_mask: segment {s} ({seq_q} x {seq_kv}) has a fully "
                "masked query row; TND masks must not contain padding rows\n"
                "  fix: drop padded tokens from the packed batch (mcore_npu.masks.padding_to_packed)"
            )
    prefix = None if options.prefix is None else [options.prefix[s]]
    return _plan(options, seq_q, seq_kv, dense_keep, prefix, device, mode=mode)
