"""``sparse_flash_attention`` (``torch_npu.npu_sparse_flash_attention``, backward
``npu_sparse_flash_attention_grad``): softmax attention over the selected keys only; its checks
and the fused kernel's autograd (the reference: :mod:`.attention_reference`)."""

from __future__ import annotations

import torch

from mcore_npu.ops import registry
from mcore_npu.ops._checks import fail, is_int, is_real
from mcore_npu.ops.dsa.attention_reference import sparse_attention_reference
from mcore_npu.ops.dsa.layout import (
    ATTENTION,
    LAYOUTS,
    SPARSE_MODES,
    check_choice,
    check_rope_pair,
    check_same_batch,
    check_tensor,
    device_of,
    lengths_as_tensors,
    segments,
    tensor_rank,
)


def validate_sparse_flash_attention(
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
) -> None:
    """Check one ``sparse_flash_attention`` call; ValueError/TypeError naming the argument."""
    op = ATTENTION
    shown = [
        (n, t)
        for n, t in (
            ("query", query),
            ("key", key),
            ("value", value),
            ("sparse_indices", sparse_indices),
            ("query_rope", query_rope),
            ("key_rope", key_rope),
        )
        if t is not None
    ]
    check_choice(op, "layout_query", layout_query, LAYOUTS, shown)
    check_choice(op, "layout_kv", layout_kv, LAYOUTS, shown)
    if layout_kv != layout_query:
        fail(
            op,
            ValueError,
            "layout_kv",
            f"{layout_kv!r} differs from layout_query {layout_query!r}",
            "use one layout for query and key/value",
            shown,
        )
    rq, rk = tensor_rank(layout_query), tensor_rank(layout_kv)
    check_tensor(op, "query", query, rq, shown)
    check_tensor(op, "key", key, rk, shown)
    check_tensor(op, "value", value, rk, shown)
    ints = (torch.int32, torch.int64)
    check_tensor(op, "sparse_indices", sparse_indices, rq, shown, ints)
    if key.shape[-1] != query.shape[-1]:
        fail(
            op,
            ValueError,
            "key",
            f"head dim {key.shape[-1]} differs from query's {query.shape[-1]}",
            "pass query and key with one head dim (512 for MLA)",
            shown,
        )
    if value.shape[:-1] != key.shape[:-1]:
        fail(
            op,
            ValueError,
            "value",
            f"shape {list(value.shape)} does not match key's {list(key.shape)} but in D",
            "pass value with key's tokens and heads",
            shown,
        )
    n1, n2 = query.shape[-2], key.shape[-2]
    if n1 % n2:
        fail(
            op,
            ValueError,
            "key",
            f"{n2} heads do not divide query's {n1}",
            "pass a head count dividing the query's (one KV head for MLA)",
            shown,
        )
    check_same_batch(op, layout_query, query, key, shown)
    if tuple(sparse_indices.shape[:-1]) != (*query.shape[:-2], n2):
        fail(
            op,
            ValueError,
            "sparse_indices",
            f"shape {list(sparse_indices.shape)}, expected {[*query.shape[:-2], n2, 'K']}",
            "pass the indexer's output (one row of K indices per query and KV head)",
            shown,
        )
    check_rope_pair(op, query_rope, key_rope, shown)
    if query_rope is not None:
        check_tensor(op, "query_rope", query_rope, rq, shown)
        check_tensor(op, "key_rope", key_rope, rk, shown)
        if query_rope.shape[:-1] != query.shape[:-1]:
            fail(
                op,
                ValueError,
                "query_rope",
                f"shape {list(query_rope.shape)} does not match "
                f"query's {list(query.shape)} but in D",
                "pass query's tokens and heads",
                shown,
            )
        if key_rope.shape[:-1] != key.shape[:-1]:
            fail(
                op,
                ValueError,
                "key_rope",
                f"shape {list(key_rope.shape)} does not match key's {list(key.shape)} but in D",
                "pass key's tokens and heads",
                shown,
            )
        if key_rope.shape[-1] != query_rope.shape[-1]:
            fail(
                op,
                ValueError,
                "key_rope",
                f"head dim {key_rope.shape[-1]} differs from query_rope's {query_rope.shape[-1]}",
                "pass one rope dim (64 for MLA)",
                shown,
            )
    if not is_real(scale_value):
        fail(
            op,
            TypeError,
            "scale_value",
            f"expected a real number, got {scale_value!r}",
            "pass 1 / sqrt(qk head dim incl. the rope part)",
            shown,
        )
    if not is_int(sparse_block_size) or sparse_block_size < 1:
        fail(
            op,
            ValueError,
            "sparse_block_size",
            f"{sparse_block_size!r} is not a positive int",
            "pass 1 (one key per index) or the indexer's block size",
            shown,
        )
    check_choice(op, "sparse_mode", sparse_mode, SPARSE_MODES, shown)
    check_choice(op, "attention_mode", attention_mode, (0, 1, 2), shown)
    if not isinstance(return_softmax_lse, bool):
        fail(
            op,
            TypeError,
            "return_softmax_lse",
            f"expected a bool, got {return_softmax_lse!r}",
            "pass True or False",
            shown,
        )
    q_segments = segments(
        op, layout_query, query, actual_seq_lengths_query, "actual_seq_lengths_query", shown
    )
    k_segments = segments(op, layout_kv, key, actual_seq_lengths_kv, "actual_seq_lengths_kv", shown)
    if len(q_segments) != len(k_segments):
        fail(
            op,
            ValueError,
            "actual_seq_lengths_kv",
            f"{len(k_segments)} sequences, query has {len(q_segments)}",
            "pass one key length per query sequence",
            shown,
        )


class _FusedSparseAttention(torch.autograd.Function):
    """``npu_sparse_flash_attention`` forward, ``npu_sparse_flash_attention_grad`` backward."""

    @staticmethod
    def forward(ctx, query, key, value, query_rope, key_rope, sparse_indices, scale_value, options):
        forward_op = registry.ascend(ATTENTION)
        out, softmax_max, softmax_sum = forward_op(
            query,
            key,
            value,
            sparse_indices,
            scale_value,
            query_rope=query_rope,
            key_rope=key_rope,
            **{**options, "return_softmax_lse": True},
        )
        ctx.save_for_backward(
            query, key, value, query_rope, key_rope, sparse_indices, out, softmax_max, softmax_sum
        )
        ctx.scale_value, ctx.options = scale_value, options
        ctx.mark_non_differentiable(softmax_max, softmax_sum)
        return out, softmax_max, softmax_sum

    @staticmethod
    def backward(ctx, grad_out, _grad_max, _grad_sum):
        query, key, value, query_rope, key_rope, indices, out, smax, ssum = ctx.saved_tensors
        o = ctx.options
        grad_op = registry.ascend(ATTENTION, attribute="npu_sparse_flash_attention_grad")
        dq, dk, dv, dqr, dkr = grad_op(
            query,
            key,
            value,
            indices,
            grad_out.contiguous(),
            out,
            smax,
            ssum,
            ctx.scale_value,
            o["sparse_block_size"],
            query_rope=query_rope,
            key_rope=key_rope,
            actual_seq_qlen=o["actual_seq_lengths_query"],
            actual_seq_kvlen=o["actual_seq_lengths_kv"],
            layout=o["layout_query"],
            sparse_mode=o["sparse_mode"],
            attention_mode=o["attention_mode"],
        )
        if query_rope is None:
            dqr = dkr = None
        return dq, dk, dv, dqr, dkr, None, None, None


def sparse_flash_attention(
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
    kernel="auto",
):
    """``torch_npu.npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value,
    ...)`` -> ``(out, softmax_max, softmax_sum)`` (see :func:`sparse_attention_reference`),
    differentiable in query, key, value, query_rope and key_rope on either kernel. The fused
    kernel takes one KV head, D = 512, a rope part of 64 and a power-of-two query head count;
    elsewhere ``auto`` falls back to the reference with the registry's one warning."""
    args = dict(
        actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_kv=actual_seq_lengths_kv,
        query_rope=query_rope,
        key_rope=key_rope,
        sparse_block_size=sparse_block_size,
        layout_query=layout_query,
        layout_kv=layout_kv,
        sparse_mode=sparse_mode,
        attention_mode=attention_mode,
        return_softmax_lse=return_softmax_lse,
    )
    validate_sparse_flash_attention(query, key, value, sparse_indices, scale_value, **args)
    chosen = registry.resolve(
        ATTENTION,
        kernel,
        device_of(query),
        query=query,
        key=key,
        query_rope=query_rope,
        attention_mode=attention_mode,
        sparse_block_size=sparse_block_size,
        grad=torch.is_grad_enabled()
        and any(
            t is not None and t.requires_grad for t in (query, key, value, query_rope, key_rope)
        ),
    ).kernel
    if chosen != "torch_npu":
        return sparse_attention_reference(query, key, value, sparse_indices, scale_value, **args)
    options = {k: v for k, v in args.items() if k not in ("query_rope", "key_rope")}
    options.update(
        lengths_as_tensors(
            query,
            actual_seq_lengths_query,
            actual_seq_lengths_kv,
            ("actual_seq_lengths_query", "actual_seq_lengths_kv"),
        )
    )
    out, softmax_max, softmax_sum = _FusedSparseAttention.apply(
        query,
        key,
        value,
        query_rope,
        key_rope,
        sparse_indices.to(torch.int32),
        scale_value,
        options,
    )
    if not return_softmax_lse:
        softmax_max = softmax_sum = softmax_max.new_empty(0)
    return out, softmax_max, softmax_sum
