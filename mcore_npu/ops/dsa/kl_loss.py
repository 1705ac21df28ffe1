"""``sparse_lightning_indexer_grad_kl_loss`` (``torch_npu.npu_sparse_lightning_indexer_grad_kl_loss``):
the indexer's KL loss against the main attention's distribution over the selected keys, and its
gradients."""

from __future__ import annotations

import torch

from mcore_npu.ops import registry
from mcore_npu.ops._checks import fail, is_real
from mcore_npu.ops.dsa.layout import (
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

KL_LOSS = "sparse_lightning_indexer_grad_kl_loss"


def validate_indexer_kl_loss(query, key, query_index, key_index, weights, sparse_indices,
                             scale_value, *, query_rope=None, key_rope=None, actual_seq_qlen=None,
                             actual_seq_klen=None, layout="BSND", sparse_mode=3) -> None:  # fmt: skip
    """Check one ``sparse_lightning_indexer_grad_kl_loss`` call (naming the argument)."""
    op = KL_LOSS
    shown = [(n, t) for n, t in (("query", query), ("key", key), ("query_index", query_index),
                                 ("key_index", key_index), ("weights", weights),
                                 ("sparse_indices", sparse_indices)) if t is not None]  # fmt: skip
    _check_choice(op, "layout", layout, LAYOUTS, shown)
    rank = _rank(layout)
    for name, t in shown[:4]:
        _check_tensor(op, name, t, rank, shown)
    _check_tensor(op, "weights", weights, rank - 1, shown)
    _check_tensor(op, "sparse_indices", sparse_indices, rank, shown, (torch.int32, torch.int64))
    for name, t in (("key", key), ("key_index", key_index)):
        if t.shape[-2] != 1:
            fail(op, ValueError, name, f"has {t.shape[-2]} heads, expected one",
                 "pass [..., 1, D] (one KV head, as MLA's latent)", shown)  # fmt: skip
    if key.shape[-1] != query.shape[-1]:
        fail(op, ValueError, "key", f"head dim {key.shape[-1]} differs from query's "
             f"{query.shape[-1]}", "pass query and key with one head dim", shown)  # fmt: skip
    if key_index.shape[-1] != query_index.shape[-1]:
        fail(op, ValueError, "key_index", f"head dim {key_index.shape[-1]} differs from "
             f"query_index's {query_index.shape[-1]}", "pass the indexer's query and key",
             shown)  # fmt: skip
    if tuple(weights.shape) != tuple(query_index.shape[:-1]):
        fail(op, ValueError, "weights", f"shape {list(weights.shape)}, expected "
             f"{list(query_index.shape[:-1])}", "pass one weight per indexer head", shown)  # fmt: skip
    if tuple(sparse_indices.shape[:-1]) != (*query.shape[:-2], 1):
        fail(op, ValueError, "sparse_indices", f"shape {list(sparse_indices.shape)}, expected "
             f"{[*query.shape[:-2], 1, 'K']}", "pass the indexer's output", shown)  # fmt: skip
    if (query_rope is None) != (key_rope is None):
        missing = "key_rope" if key_rope is None else "query_rope"
        fail(op, ValueError, missing, "is None while the other rope part is given",
             "pass both query_rope and key_rope, or neither", shown)  # fmt: skip
    if not is_real(scale_value):
        fail(op, TypeError, "scale_value", f"expected a real number, got {scale_value!r}",
             "pass the main attention's softmax scale", shown)  # fmt: skip
    _check_choice(op, "sparse_mode", sparse_mode, SPARSE_MODES, shown)
    _segments(op, layout, query, actual_seq_qlen, "actual_seq_qlen", shown)
    _segments(op, layout, key, actual_seq_klen, "actual_seq_klen", shown)


def indexer_kl_loss_reference(query, key, query_index, key_index, weights, sparse_indices,
                              softmax_max, softmax_sum, scale_value, *, query_rope=None,
                              key_rope=None, actual_seq_qlen=None, actual_seq_klen=None,
                              layout="BSND", sparse_mode=3):  # fmt: skip
    """``(d_query_index, d_key_index, d_weights, loss)`` of ``loss = sum_t KL(p_t || softmax(I_t))``
    over each query's selected (visible) keys: ``p_t`` the main attention's probabilities summed
    over the heads and L1-normalized, ``I_t`` the indexer scores. ``softmax_max`` /
    ``softmax_sum`` are not read: ``p`` is recomputed from query, key and the rope parts. The
    loss is float32 of shape ``[1]``; the gradients take their inputs' dtypes."""
    del softmax_max, softmax_sum
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    with torch.enable_grad():  # it takes its own gradients, in any grad mode
        leaves = [t.detach().to(compute).requires_grad_() for t in (query_index, key_index,
                                                                    weights)]  # fmt: skip
        qi_all, ki_all, w_all = leaves
        loss = torch.zeros((), dtype=compute, device=query.device)
        q_segments = _segments(KL_LOSS, layout, query, actual_seq_qlen, "", ())
        k_segments = _segments(KL_LOSS, layout, key, actual_seq_klen, "", ())
        for (b, q0, sq), (kb, k0, skv) in zip(q_segments, k_segments):
            if skv == 0 or sq == 0:
                continue
            main = [_seq(t, layout, b, q0, sq).to(compute) for t in (query, query_rope)
                    if t is not None]  # fmt: skip
            keys = [_seq(t, layout, kb, k0, skv)[:, 0].to(compute) for t in (key, key_rope)
                    if t is not None]  # fmt: skip
            index = (_seq(qi_all, layout, b, q0, sq), _seq(ki_all, layout, kb, k0, skv)[:, 0],
                     _seq(w_all, layout, b, q0, sq))  # fmt: skip
            chosen = _seq(sparse_indices, layout, b, q0, sq)[:, 0].long()  # [sq, K]
            for s in range(0, sq, QUERY_BLOCK):
                rows = slice(s, min(s + QUERY_BLOCK, sq))
                loss = loss + _block_loss(main, keys, index, chosen, rows, skv - sq,
                                          scale_value, sparse_mode)  # fmt: skip
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    d_qi, d_ki, d_w = (g.to(t.dtype) for g, t in zip(grads, (query_index, key_index, weights)))
    return d_qi, d_ki, d_w, loss.detach().float().reshape(1)


def _block_loss(main, keys, index, chosen, rows, offset, scale_value, sparse_mode):
    """``sum KL(p || softmax(I))`` of the queries ``rows`` of one sequence: ``main`` the
    attention's query (and rope) ``[sq, N, D]``, ``keys`` its key (and rope) ``[skv, D]``,
    ``index`` the indexer's query, key and weights, ``chosen`` ``[sq, K]`` key positions."""
    qi, ki, w = index
    pos = chosen[rows]
    keep = (pos >= 0) & (pos < keys[0].shape[0])
    if sparse_mode == 3:
        keep &= pos <= torch.arange(rows.start, rows.stop, device=pos.device)[:, None] + offset
    pos = pos.clamp(0, keys[0].shape[0] - 1)
    with torch.no_grad():  # the target distribution
        logits = sum(torch.einsum("qnd,qmd->qnm", q[rows], k[pos]) for q, k in zip(main, keys))
        logits = (logits * scale_value).masked_fill(~keep[:, None], float("-inf"))
        probs = torch.softmax(logits, -1).nan_to_num(0.0).sum(1)  # [blk, M]
        tiny = torch.finfo(probs.dtype).tiny
        target = probs / probs.sum(-1, keepdim=True).clamp_min(tiny)
    scores = torch.einsum("qnd,qmd->qnm", qi[rows], ki[pos]).relu()
    scores = torch.einsum("qnm,qn->qm", scores, w[rows]).masked_fill(~keep, float("-inf"))
    log_q = torch.log_softmax(scores, -1).masked_fill(~keep, 0.0)
    log_p = torch.where(target > 0, target, 1).log()
    return (target * (log_p - log_q)).sum()


def sparse_lightning_indexer_grad_kl_loss(query, key, query_index, key_index, weights,
                                          sparse_indices, softmax_max, softmax_sum, scale_value,
                                          *, query_rope=None, key_rope=None,
                                          actual_seq_qlen=None, actual_seq_klen=None,
                                          layout="BSND", sparse_mode=3, kernel="auto"):  # fmt: skip
    """``torch_npu.npu_sparse_lightning_indexer_grad_kl_loss(...)``: the indexer's KL loss
    against the main attention and its gradients (:func:`indexer_kl_loss_reference`). On the
    NPU, softmax_max / softmax_sum are :func:`sparse_flash_attention`'s statistics."""
    args = dict(query_rope=query_rope, key_rope=key_rope, actual_seq_qlen=actual_seq_qlen,
                actual_seq_klen=actual_seq_klen, layout=layout, sparse_mode=sparse_mode)  # fmt: skip
    validate_indexer_kl_loss(query, key, query_index, key_index, weights, sparse_indices,
                             scale_value, **args)  # fmt: skip
    chosen = registry.resolve(KL_LOSS, kernel, _device(query), query=query,
                              query_index=query_index, query_rope=query_rope,
                              sparse_count=sparse_indices.shape[-1]).kernel  # fmt: skip
    call = (query, key, query_index, key_index, weights, sparse_indices, softmax_max, softmax_sum,
            scale_value)  # fmt: skip
    if chosen == "torch_npu":
        args.update(_lengths_as_tensors(query, actual_seq_qlen, actual_seq_klen,
                                        ("actual_seq_qlen", "actual_seq_klen")))  # fmt: skip
        return registry.ascend(KL_LOSS)(*call, **args)
    return indexer_kl_loss_reference(*call, **args)
