"""``lightning_indexer`` (``torch_npu.npu_lightning_indexer``): for each query, the ``sparse_count``
keys of highest score ``sum_h weights[h] * relu(q_h . k)``; int32 ``[B, S, 1, K]`` / ``[T, 1, K]``,
-1 where fewer keys exist. The reference scores ``QUERY_BLOCK`` queries at a time."""

from __future__ import annotations

import torch

from mcore_npu.ops import registry
from mcore_npu.ops._checks import fail, is_int
from mcore_npu.ops.dsa.layout import (
    INDEXER,
    LAYOUTS,
    QUERY_BLOCK,
    SPARSE_MODES,
    check_choice,
    check_same_batch,
    check_tensor,
    device_of,
    lengths_as_tensors,
    segments,
    sequence,
    tensor_rank,
)


def validate_lightning_indexer(
    query,
    key,
    weights,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    layout_query="BSND",
    layout_key="BSND",
    sparse_count=2048,
    sparse_mode=3,
    return_value=False,
) -> None:
    """Check one ``lightning_indexer`` call; ValueError/TypeError naming the argument."""
    shown = [("query", query), ("key", key), ("weights", weights)]
    op = INDEXER
    check_choice(op, "layout_query", layout_query, LAYOUTS, shown)
    check_choice(op, "layout_key", layout_key, LAYOUTS, shown)
    if layout_key != layout_query:
        fail(
            op,
            ValueError,
            "layout_key",
            f"{layout_key!r} differs from layout_query {layout_query!r}",
            "use one layout for query and key",
            shown,
        )
    check_tensor(op, "query", query, tensor_rank(layout_query), shown)
    check_tensor(op, "key", key, tensor_rank(layout_key), shown)
    check_tensor(op, "weights", weights, tensor_rank(layout_query) - 1, shown)
    if key.shape[-2] != 1:
        fail(
            op,
            ValueError,
            "key",
            f"has {key.shape[-2]} heads, the indexer key has one",
            "pass the indexer key as [..., 1, D]",
            shown,
        )
    if key.shape[-1] != query.shape[-1]:
        fail(
            op,
            ValueError,
            "key",
            f"head dim {key.shape[-1]} differs from query's {query.shape[-1]}",
            "project query and key to the same indexer head dim",
            shown,
        )
    if tuple(weights.shape) != tuple(query.shape[:-1]):
        fail(
            op,
            ValueError,
            "weights",
            f"shape {list(weights.shape)}, expected {list(query.shape[:-1])} (query without D)",
            "pass one weight per query head",
            shown,
        )
    check_same_batch(op, layout_query, query, key, shown)
    if not is_int(sparse_count) or sparse_count < 1:
        fail(
            op,
            ValueError,
            "sparse_count",
            f"{sparse_count!r} is not a positive int",
            "pass the number of keys to select per query, such as 2048",
            shown,
        )
    check_choice(op, "sparse_mode", sparse_mode, SPARSE_MODES, shown)
    if not isinstance(return_value, bool):
        fail(
            op,
            TypeError,
            "return_value",
            f"expected a bool, got {return_value!r}",
            "pass True or False",
            shown,
        )
    q_segments = segments(
        op, layout_query, query, actual_seq_lengths_query, "actual_seq_lengths_query", shown
    )
    k_segments = segments(
        op, layout_key, key, actual_seq_lengths_key, "actual_seq_lengths_key", shown
    )
    if len(q_segments) != len(k_segments):
        fail(
            op,
            ValueError,
            "actual_seq_lengths_key",
            f"{len(k_segments)} sequences, query has {len(q_segments)}",
            "pass one key length per query sequence",
            shown,
        )


def indexer_reference(
    query,
    key,
    weights,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    layout_query="BSND",
    layout_key="BSND",
    sparse_count=2048,
    sparse_mode=3,
    return_value=False,
):
    """``(sparse_indices, sparse_values)``: int32 ``[B, S1, 1, K]`` (BSND) or ``[T1, 1, K]``
    (TND) key positions inside each sequence, best first, -1 where fewer keys are visible; the
    values are the scores (query's dtype; -inf at -1; an empty tensor unless ``return_value``).
    Scores in float32 (float64 for float64 inputs), computed ``QUERY_BLOCK`` queries at a time."""
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    lead = query.shape[:-2]
    indices = torch.full((*lead, 1, sparse_count), -1, dtype=torch.int32, device=query.device)
    values = torch.full((*lead, 1, sparse_count), float("-inf"), dtype=compute, device=query.device)
    q_segments = segments(INDEXER, layout_query, query, actual_seq_lengths_query, "", ())
    k_segments = segments(INDEXER, layout_key, key, actual_seq_lengths_key, "", ())
    for (b, q0, sq), (kb, k0, skv) in zip(q_segments, k_segments):
        q = sequence(query, layout_query, b, q0, sq).to(compute)  # [sq, N, D]
        k = sequence(key, layout_key, kb, k0, skv)[:, 0].to(compute)  # [skv, D]
        w = sequence(weights, layout_query, b, q0, sq).to(compute)  # [sq, N]
        out_i = sequence(indices, layout_query, b, q0, sq)
        out_v = sequence(values, layout_query, b, q0, sq)
        for s in range(0, sq, QUERY_BLOCK):
            e = min(s + QUERY_BLOCK, sq)
            scores = torch.einsum("qnd,kd->qnk", q[s:e], k).relu()
            scores = torch.einsum("qnk,qn->qk", scores, w[s:e])  # [block, skv]
            if sparse_mode == 3:
                rows = torch.arange(s, e, device=query.device)[:, None] + (skv - sq)
                hidden = torch.arange(skv, device=query.device)[None, :] > rows
                scores = scores.masked_fill(hidden, float("-inf"))
            take = min(sparse_count, skv)
            if take == 0:
                continue
            best, where = _top(scores, take)
            where = where.to(torch.int32).masked_fill(best == float("-inf"), -1)
            out_i[s:e, 0, :take] = where
            out_v[s:e, 0, :take] = best
    values = values.to(query.dtype) if return_value else values.new_empty(0).to(query.dtype)
    return indices, values


def _top(scores, take: int):
    """The ``take`` best scores per row and their key positions, equal scores in key order (a
    stable sort: the same choice whatever the number of masked keys after them)."""
    best, where = scores.sort(dim=-1, descending=True, stable=True)
    return best[..., :take], where[..., :take]


def lightning_indexer(
    query,
    key,
    weights,
    *,
    actual_seq_lengths_query=None,
    actual_seq_lengths_key=None,
    layout_query="BSND",
    layout_key="BSND",
    sparse_count=2048,
    sparse_mode=3,
    return_value=False,
    kernel="auto",
):
    """``torch_npu.npu_lightning_indexer(query, key, weights, ...)``: query ``[B, S1, N, D]``
    / ``[T1, N, D]``, key ``[B, S2, 1, D]`` / ``[T2, 1, D]``, weights ``[B, S1, N]`` /
    ``[T1, N]`` -> ``(sparse_indices, sparse_values)`` as :func:`indexer_reference` says."""
    args = dict(
        actual_seq_lengths_query=actual_seq_lengths_query,
        actual_seq_lengths_key=actual_seq_lengths_key,
        layout_query=layout_query,
        layout_key=layout_key,
        sparse_count=sparse_count,
        sparse_mode=sparse_mode,
        return_value=return_value,
    )
    validate_lightning_indexer(query, key, weights, **args)
    chosen = registry.resolve(
        INDEXER, kernel, device_of(query), query=query, key=key, layout=layout_query
    ).kernel
    if chosen == "torch_npu":
        npu_args = {
            **args,
            **lengths_as_tensors(
                query,
                actual_seq_lengths_query,
                actual_seq_lengths_key,
                ("actual_seq_lengths_query", "actual_seq_lengths_key"),
            ),
        }
        return registry.ascend(INDEXER)(query, key, weights, **npu_args)
    return indexer_reference(query, key, weights, **args)
