"""``sparse_flash_attention`` (``torch_npu.npu_sparse_flash_attention``, backward
``npu_sparse_flash_attention_grad``): softmax attention over the selected keys only. The reference
gathers ``[block, K * sparse_block_size, D]`` keys per ``QUERY_BLOCK`` queries."""

from __future__ import annotations

import functools

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
    (BSND) / ``[N2, T1, G]`` (TND), G = N1 / N2; empty unless ``return_softmax_lse``.
    Differentiable in query, key, value, query_rope and key_rope with its own backward (flash
    attention style: the forward keeps its inputs and each query's softmax max and sum, the
    backward gathers one block of keys again at a time), so no gathered keys stay alive between
    the two; float64 stays float64. ``attention_mode`` changes only the fused kernel's
    scheduling (2: absorbed MLA)."""
    options = dict(actual_seq_lengths_query=actual_seq_lengths_query,
                   actual_seq_lengths_kv=actual_seq_lengths_kv,
                   sparse_block_size=sparse_block_size, layout_query=layout_query,
                   layout_kv=layout_kv, sparse_mode=sparse_mode)  # fmt: skip
    out, smax, ssum = _ReferenceSparseAttention.apply(
        query, key, value, query_rope, key_rope, sparse_indices, scale_value, options)  # fmt: skip
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
    def forward(ctx, query, key, value, query_rope, key_rope, sparse_indices, scale_value,
                options):  # fmt: skip
        compute = _compute_dtype(query)
        _warm_exp(compute, query.device.type)
        tokens = query.shape[:-1]
        out = query.new_zeros(*tokens, value.shape[-1], dtype=compute)
        smax = query.new_full(tokens, float("-inf"), dtype=compute)  # no key: max -inf, sum 0
        ssum = query.new_zeros(tokens, dtype=compute)
        for block in _blocks(query, key, value, query_rope, key_rope, sparse_indices, options):
            _forward_block(block, scale_value, out, smax, ssum)
            del block  # its gathered keys go before the next block's are gathered
        ctx.save_for_backward(query, key, value, query_rope, key_rope, sparse_indices, smax,
                              ssum)  # fmt: skip
        ctx.scale_value, ctx.options = scale_value, options
        ctx.mark_non_differentiable(smax, ssum)
        return out.to(query.dtype), smax, ssum

    @staticmethod
    def backward(ctx, grad_out, _grad_max, _grad_sum):
        query, key, value, query_rope, key_rope, indices, smax, ssum = ctx.saved_tensors
        inputs = (query, key, value, query_rope, key_rope)
        compute = _compute_dtype(query)
        grad_out = grad_out.to(compute)
        grads = [t.new_zeros(t.shape, dtype=compute) if t is not None and need else None
                 for t, need in zip(inputs, ctx.needs_input_grad)]  # fmt: skip
        for block in _blocks(query, key, value, query_rope, key_rope, indices, ctx.options):
            _backward_block(block, ctx.scale_value, smax, ssum, grad_out, grads)
            del block
        return (*(None if g is None else g.to(t.dtype) for g, t in zip(grads, inputs)), None,
                None, None)  # fmt: skip


def _probabilities(score, top, denominator):
    """The softmax of ``score`` (``[block, G, M]``) from its max and sum (``[block, G, 1]``):
    zeros where no key counts."""
    weights = (score - torch.where(torch.isfinite(top), top, 0)).exp()
    return weights / torch.where(denominator > 0, denominator, 1)


def _forward_block(block, scale_value, out, smax, ssum):
    """Write the block's output rows, softmax max and sum into ``out`` / ``smax`` / ``ssum``."""
    score = block.scores(scale_value)
    top = score.amax(-1, keepdim=True)
    weights = (score - torch.where(torch.isfinite(top), top, 0)).exp()  # as _probabilities
    denominator = weights.sum(-1, keepdim=True)
    probs = weights / torch.where(denominator > 0, denominator, 1)
    block.rows(out)[:] = torch.einsum("qgm,qmd->qgd", probs, block.v)
    block.rows(smax)[:] = top[..., 0]
    block.rows(ssum)[:] = denominator[..., 0]


def _backward_block(block, scale_value, smax, ssum, grad_out, grads):
    """Add the block's share to ``grads`` (query, key, value, query_rope, key_rope; None: not
    wanted): its probabilities again from the saved max and sum, then the softmax backward."""
    dq, dk, dv, dqr, dkr = grads
    score = block.scores(scale_value)
    probs = _probabilities(score, block.rows(smax)[..., None], block.rows(ssum)[..., None])
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
    for grad, pulled, by in ((dk, d_score, block.q), (dv, probs, d_out),
                             (dkr, d_score, block.qr)):  # fmt: skip
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
    q_segments = _segments(ATTENTION, layout_q, query, options["actual_seq_lengths_query"], "",
                           ())  # fmt: skip
    k_segments = _segments(ATTENTION, layout_kv, key, options["actual_seq_lengths_kv"], "", ())
    n2 = key.shape[-2]
    group = query.shape[-2] // n2
    offsets = torch.arange(size, device=query.device)
    for (b, q0, sq), (kb, k0, skv) in zip(q_segments, k_segments):
        if sq == 0 or skv == 0:
            continue

        def q_seq(t, b=b, q0=q0, sq=sq):
            return _seq(t, layout_q, b, q0, sq)

        def kv_seq(t, kb=kb, k0=k0, skv=skv):
            return _seq(t, layout_kv, kb, k0, skv)

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
                yield _Block(q_rows, kv_rows, flat, keep[:, h], q[s:e, heads],
                             *(_gather(t, h, flat, e - s) for t in (k, v)),
                             None if qr is None else qr[s:e, heads], _gather(kr, h, flat, e - s))  # fmt: skip


def _gather(t, head, flat, queries):
    """``[queries, M, D]``: the rows ``flat`` of ``t[:, head]`` (None stays None)."""
    return None if t is None else t[:, head].index_select(0, flat).view(queries, -1, t.shape[-1])


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
