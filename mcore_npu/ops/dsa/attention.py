"""``sparse_flash_attention`` (``torch_npu.npu_sparse_flash_attention``, backward
``npu_sparse_flash_attention_grad``): softmax attention over the selected keys only. The reference
gathers ``[block, K * sparse_block_size, D]`` keys per ``QUERY_BLOCK`` queries."""

from __future__ import annotations

import torch

from mcore_npu.ops import registry
from mcore_npu.ops._checks import fail, is_int, is_real
from mcore_npu.ops.dsa.layout import (
    ATTENTION,
    LAYOUTS,
    QUERY_BLOCK,
    SPARSE_MODES,
    _check_choice,
    _check_tensor,
    _device,
    _lengths_as_tensors,
    _rank,
    _segments,
    _seq,
)


def validate_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *,
                                    actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
                                    query_rope=None, key_rope=None, sparse_block_size=1,
                                    layout_query="BSND", layout_kv="BSND", sparse_mode=3,
                                    attention_mode=2, return_softmax_lse=False) -> None:  # fmt: skip
    """Check one ``sparse_flash_attention`` call; ValueError/TypeError naming the argument."""
    op = ATTENTION
    shown = [(n, t) for n, t in (("query", query), ("key", key), ("value", value),
                                 ("sparse_indices", sparse_indices), ("query_rope", query_rope),
                                 ("key_rope", key_rope)) if t is not None]  # fmt: skip
    _check_choice(op, "layout_query", layout_query, LAYOUTS, shown)
    _check_choice(op, "layout_kv", layout_kv, LAYOUTS, shown)
    if layout_kv != layout_query:
        fail(op, ValueError, "layout_kv", f"{layout_kv!r} differs from layout_query "
             f"{layout_query!r}", "use one layout for query and key/value", shown)  # fmt: skip
    rq, rk = _rank(layout_query), _rank(layout_kv)
    _check_tensor(op, "query", query, rq, shown)
    _check_tensor(op, "key", key, rk, shown)
    _check_tensor(op, "value", value, rk, shown)
    ints = (torch.int32, torch.int64)
    _check_tensor(op, "sparse_indices", sparse_indices, rq, shown, ints)
    if key.shape[-1] != query.shape[-1]:
        fail(op, ValueError, "key", f"head dim {key.shape[-1]} differs from query's "
             f"{query.shape[-1]}", "pass query and key with one head dim (512 for MLA)", shown)  # fmt: skip
    if value.shape[:-1] != key.shape[:-1]:
        fail(op, ValueError, "value", f"shape {list(value.shape)} does not match key's "
             f"{list(key.shape)} but in D", "pass value with key's tokens and heads", shown)  # fmt: skip
    n1, n2 = query.shape[-2], key.shape[-2]
    if n1 % n2:
        fail(op, ValueError, "key", f"{n2} heads do not divide query's {n1}",
             "pass a head count dividing the query's (one KV head for MLA)", shown)  # fmt: skip
    if layout_query == "BSND" and key.shape[0] != query.shape[0]:
        fail(op, ValueError, "key", f"batch {key.shape[0]} differs from query's {query.shape[0]}",
             "pass one key sequence per batch", shown)  # fmt: skip
    if tuple(sparse_indices.shape[:-1]) != (*query.shape[:-2], n2):
        fail(op, ValueError, "sparse_indices", f"shape {list(sparse_indices.shape)}, expected "
             f"{[*query.shape[:-2], n2, 'K']}", "pass the indexer's output (one row of K "
             "indices per query and KV head)", shown)  # fmt: skip
    if (query_rope is None) != (key_rope is None):
        missing = "key_rope" if key_rope is None else "query_rope"
        fail(op, ValueError, missing, "is None while the other rope part is given",
             "pass both query_rope and key_rope, or neither", shown)  # fmt: skip
    if query_rope is not None:
        _check_tensor(op, "query_rope", query_rope, rq, shown)
        _check_tensor(op, "key_rope", key_rope, rk, shown)
        if query_rope.shape[:-1] != query.shape[:-1]:
            fail(op, ValueError, "query_rope", f"shape {list(query_rope.shape)} does not match "
                 f"query's {list(query.shape)} but in D", "pass query's tokens and heads", shown)  # fmt: skip
        if key_rope.shape[:-1] != key.shape[:-1]:
            fail(op, ValueError, "key_rope", f"shape {list(key_rope.shape)} does not match "
                 f"key's {list(key.shape)} but in D", "pass key's tokens and heads", shown)  # fmt: skip
        if key_rope.shape[-1] != query_rope.shape[-1]:
            fail(op, ValueError, "key_rope", f"head dim {key_rope.shape[-1]} differs from "
                 f"query_rope's {query_rope.shape[-1]}", "pass one rope dim (64 for MLA)", shown)  # fmt: skip
    if not is_real(scale_value):
        fail(op, TypeError, "scale_value", f"expected a real number, got {scale_value!r}",
             "pass 1 / sqrt(qk head dim incl. the rope part)", shown)  # fmt: skip
    if not is_int(sparse_block_size) or sparse_block_size < 1:
        fail(op, ValueError, "sparse_block_size", f"{sparse_block_size!r} is not a positive "
             "int", "pass 1 (one key per index) or the indexer's block size", shown)  # fmt: skip
    _check_choice(op, "sparse_mode", sparse_mode, SPARSE_MODES, shown)
    _check_choice(op, "attention_mode", attention_mode, (0, 1, 2), shown)
    if not isinstance(return_softmax_lse, bool):
        fail(op, TypeError, "return_softmax_lse", f"expected a bool, got "
             f"{return_softmax_lse!r}", "pass True or False", shown)  # fmt: skip
    q_segments = _segments(op, layout_query, query, actual_seq_lengths_query,
                           "actual_seq_lengths_query", shown)  # fmt: skip
    k_segments = _segments(op, layout_kv, key, actual_seq_lengths_kv, "actual_seq_lengths_kv",
                           shown)  # fmt: skip
    if len(q_segments) != len(k_segments):
        fail(op, ValueError, "actual_seq_lengths_kv", f"{len(k_segments)} sequences, query has "
             f"{len(q_segments)}", "pass one key length per query sequence", shown)  # fmt: skip


def sparse_attention_reference(query, key, value, sparse_indices, scale_value, *,
                               actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
                               query_rope=None, key_rope=None, sparse_block_size=1,
                               layout_query="BSND", layout_kv="BSND", sparse_mode=3,
                               attention_mode=2, return_softmax_lse=False):  # fmt: skip
    """``(out, softmax_max, softmax_sum)``: out has query's layout with value's D; query ``i``
    attends the keys ``[idx * sparse_block_size, (idx + 1) * sparse_block_size)`` of each of its
    indices (-1: none; keys past the sequence or, in mode 3, after the causal bound are
    dropped), with scores ``(q . k + q_rope . k_rope) * scale_value``. A query that sees no key
    gets zeros. softmax_max / softmax_sum: float32, laid out as the kernel's ``[B, N2, S1, G]``
    (BSND) / ``[N2, T1, G]`` (TND), G = N1 / N2; empty unless ``return_softmax_lse``. Differentiable through autograd; float64 stays float64.
    ``attention_mode`` changes only the fused kernel's scheduling (2: absorbed MLA)."""
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    q_segments = _segments(ATTENTION, layout_query, query, actual_seq_lengths_query, "", ())
    k_segments = _segments(ATTENTION, layout_kv, key, actual_seq_lengths_kv, "", ())
    n1, n2 = query.shape[-2], key.shape[-2]
    group = n1 // n2
    offsets = torch.arange(sparse_block_size, device=query.device)
    pieces, max_pieces, sum_pieces = [], [], []
    for (b, q0, sq), (kb, k0, skv) in zip(q_segments, k_segments):
        q = _seq(query, layout_query, b, q0, sq).to(compute)
        k = _seq(key, layout_kv, kb, k0, skv).to(compute)
        v = _seq(value, layout_kv, kb, k0, skv).to(compute)
        idx = _seq(sparse_indices, layout_query, b, q0, sq).long()  # [sq, N2, K]
        qr = kr = None
        if query_rope is not None:
            qr = _seq(query_rope, layout_query, b, q0, sq).to(compute)
            kr = _seq(key_rope, layout_kv, kb, k0, skv).to(compute)
        if skv == 0:  # nothing to attend: one zero key to gather from, never kept
            k, v = k.new_zeros(1, *k.shape[1:]), v.new_zeros(1, *v.shape[1:])
            kr = None if kr is None else kr.new_zeros(1, *kr.shape[1:])
        rows_out, rows_max, rows_sum = [], [], []
        for s in range(0, sq, QUERY_BLOCK):
            e = min(s + QUERY_BLOCK, sq)
            # key positions [block, N2, K * bs] and which of them count
            pos = (idx[s:e, :, :, None] * sparse_block_size + offsets).flatten(-2)
            keep = (idx[s:e, :, :, None] >= 0).expand(-1, -1, -1, sparse_block_size).flatten(-2)
            keep &= pos < skv
            if sparse_mode == 3:
                bound = torch.arange(s, e, device=query.device)[:, None, None] + (skv - sq)
                keep &= pos <= bound
            pos = pos.clamp(0, max(skv - 1, 0))
            heads_out, heads_max, heads_sum = [], [], []
            for h in range(n2):
                p = pos[:, h]  # [block, M]
                kh, vh = k[:, h][p], v[:, h][p]  # [block, M, D]
                qh = q[s:e, h * group : (h + 1) * group]  # [block, G, D]
                score = torch.einsum("qgd,qmd->qgm", qh, kh)
                if qr is not None:
                    krh = kr[:, h][p]
                    score = score + torch.einsum("qgd,qmd->qgm", qr[s:e, h * group :
                                                                      (h + 1) * group], krh)  # fmt: skip
                score = (score * scale_value).masked_fill(~keep[:, h, None, :], float("-inf"))
                top = score.amax(-1, keepdim=True).detach()
                top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
                weights = (score - top).exp()
                denominator = weights.sum(-1, keepdim=True)
                probs = weights / torch.where(denominator > 0, denominator, 1)
                heads_out.append(torch.einsum("qgm,qmd->qgd", probs, vh))
                heads_max.append(score.amax(-1).detach())
                heads_sum.append(denominator[..., 0].detach())
            rows_out.append(torch.cat(heads_out, 1))
            rows_max.append(torch.cat(heads_max, 1))
            rows_sum.append(torch.cat(heads_sum, 1))
        rows = [torch.cat(r) if r else q.new_zeros((0, n1, *shape)) for r, shape in
                ((rows_out, (value.shape[-1],)), (rows_max, ()), (rows_sum, ()))]  # fmt: skip
        if layout_query == "BSND":  # pad each batch to S1: zeros, max -inf, sum 0
            pad = query.shape[1] - sq
            rows = [torch.cat([r, torch.full((pad, *r.shape[1:]), fill, dtype=compute,
                                             device=query.device)])
                    for r, fill in zip(rows, (0.0, float("-inf"), 0.0))]  # fmt: skip
        pieces.append(rows[0])
        max_pieces.append(rows[1])
        sum_pieces.append(rows[2])
    join = torch.stack if layout_query == "BSND" else torch.cat
    out = join(pieces).to(query.dtype)
    stats, sums = (
        _kernel_stats_layout(join(t), layout_query, n2) for t in (max_pieces, sum_pieces)
    )
    if not return_softmax_lse:
        stats = sums = stats.new_empty(0)
    return out, stats.float(), sums.float()


def _kernel_stats_layout(stats, layout, kv_heads):
    """``[B, S1, N1]`` / ``[T1, N1]`` -> the kernel's ``[B, N2, S1, G]`` / ``[N2, T1, G]``."""
    if layout == "BSND":
        return stats.unflatten(-1, (kv_heads, -1)).permute(0, 2, 1, 3)
    return stats.unflatten(-1, (kv_heads, -1)).permute(1, 0, 2)


class _FusedSparseAttention(torch.autograd.Function):
    """``npu_sparse_flash_attention`` forward, ``npu_sparse_flash_attention_grad`` backward."""

    @staticmethod
    def forward(ctx, query, key, value, query_rope, key_rope, sparse_indices, scale_value,
                options):  # fmt: skip
        forward_op = registry.ascend(ATTENTION)
        out, softmax_max, softmax_sum = forward_op(
            query, key, value, sparse_indices, scale_value, query_rope=query_rope,
            key_rope=key_rope, **{**options, "return_softmax_lse": True})  # fmt: skip
        ctx.save_for_backward(query, key, value, query_rope, key_rope, sparse_indices, out,
                              softmax_max, softmax_sum)  # fmt: skip
        ctx.scale_value, ctx.options = scale_value, options
        ctx.mark_non_differentiable(softmax_max, softmax_sum)
        return out, softmax_max, softmax_sum

    @staticmethod
    def backward(ctx, grad_out, _grad_max, _grad_sum):
        query, key, value, query_rope, key_rope, indices, out, smax, ssum = ctx.saved_tensors
        o = ctx.options
        grad_op = registry.ascend(ATTENTION, attribute="npu_sparse_flash_attention_grad")
        dq, dk, dv, dqr, dkr = grad_op(
            query, key, value, indices, grad_out.contiguous(), out, smax, ssum, ctx.scale_value,
            o["sparse_block_size"], query_rope=query_rope, key_rope=key_rope,
            actual_seq_qlen=o["actual_seq_lengths_query"],
            actual_seq_kvlen=o["actual_seq_lengths_kv"], layout=o["layout_query"],
            sparse_mode=o["sparse_mode"], attention_mode=o["attention_mode"])  # fmt: skip
        if query_rope is None:
            dqr = dkr = None
        return dq, dk, dv, dqr, dkr, None, None, None


def sparse_flash_attention(query, key, value, sparse_indices, scale_value, *,
                           actual_seq_lengths_query=None, actual_seq_lengths_kv=None,
                           query_rope=None, key_rope=None, sparse_block_size=1,
                           layout_query="BSND", layout_kv="BSND", sparse_mode=3,
                           attention_mode=2, return_softmax_lse=False, kernel="auto"):  # fmt: skip
    """``torch_npu.npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value,
    ...)`` -> ``(out, softmax_max, softmax_sum)`` (see :func:`sparse_attention_reference`),
    differentiable in query, key, value, query_rope and key_rope on either kernel. The fused
    kernel takes one KV head, D = 512, a rope part of 64 and a power-of-two query head count;
    elsewhere ``auto`` falls back to the reference with the registry's one warning."""
    args = dict(actual_seq_lengths_query=actual_seq_lengths_query,
                actual_seq_lengths_kv=actual_seq_lengths_kv, query_rope=query_rope,
                key_rope=key_rope, sparse_block_size=sparse_block_size,
                layout_query=layout_query, layout_kv=layout_kv, sparse_mode=sparse_mode,
                attention_mode=attention_mode, return_softmax_lse=return_softmax_lse)  # fmt: skip
    validate_sparse_flash_attention(query, key, value, sparse_indices, scale_value, **args)
    chosen = registry.resolve(
        ATTENTION, kernel, _device(query), query=query, key=key, query_rope=query_rope,
        attention_mode=attention_mode, sparse_block_size=sparse_block_size,
        grad=torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value, query_rope, key_rope)),
    ).kernel  # fmt: skip
    if chosen != "torch_npu":
        return sparse_attention_reference(query, key, value, sparse_indices, scale_value, **args)
    options = {k: v for k, v in args.items() if k not in ("query_rope", "key_rope")}
    options.update(_lengths_as_tensors(query, actual_seq_lengths_query, actual_seq_lengths_kv,
                                       ("actual_seq_lengths_query", "actual_seq_lengths_kv")))  # fmt: skip
    out, softmax_max, softmax_sum = _FusedSparseAttention.apply(
        query, key, value, query_rope, key_rope, sparse_indices.to(torch.int32), scale_value,
        options)  # fmt: skip
    if not return_softmax_lse:
        softmax_max = softmax_sum = softmax_max.new_empty(0)
    return out, softmax_max, softmax_sum


# --------------------------------------------------------------------------------- indexer loss
