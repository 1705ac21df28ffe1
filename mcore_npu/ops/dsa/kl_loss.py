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
    check_choice,
    check_rope_pair,
    check_tensor,
    device_of,
    lengths_as_tensors,
    segments,
    sequence,
    tensor_rank,
)

KL_LOSS = "sparse_lightning_indexer_grad_kl_loss"


def validate_indexer_kl_loss(
    query,
    key,
    query_index,
    key_index,
    weights,
    sparse_indices,
    scale_value,
    *,
    query_rope=None,
    key_rope=None,
    actual_seq_qlen=None,
    actual_seq_klen=None,
    layout="BSND",
    sparse_mode=3,
) -> None:
    """Check one ``sparse_lightning_indexer_grad_kl_loss`` call (naming the argument)."""
    op = KL_LOSS
    shown = [
        (n, t)
        for n, t in (
            ("query", query),
            ("key", key),
            ("query_index", query_index),
            ("key_index", key_index),
            ("weights", weights),
            ("sparse_indices", sparse_indices),
        )
        if t is not None
    ]
    check_choice(op, "layout", layout, LAYOUTS, shown)
    rank = tensor_rank(layout)
    for name, t in shown[:4]:
        check_tensor(op, name, t, rank, shown)
    check_tensor(op, "weights", weights, rank - 1, shown)
    check_tensor(op, "sparse_indices", sparse_indices, rank, shown, (torch.int32, torch.int64))
    for name, t in (("key", key), ("key_index", key_index)):
        if t.shape[-2] != 1:
            fail(
                op,
                ValueError,
                name,
                f"has {t.shape[-2]} heads, expected one",
                "pass [..., 1, D] (one KV head, as MLA's latent)",
                shown,
            )
    if key.shape[-1] != query.shape[-1]:
        fail(
            op,
            ValueError,
            "key",
            f"head dim {key.shape[-1]} differs from query's {query.shape[-1]}",
            "pass query and key with one head dim",
            shown,
        )
    if key_index.shape[-1] != query_index.shape[-1]:
        fail(
            op,
            ValueError,
            "key_index",
            f"head dim {key_index.shape[-1]} differs from query_index's {query_index.shape[-1]}",
            "pass the indexer's query and key",
            shown,
        )
    if tuple(weights.shape) != tuple(query_index.shape[:-1]):
        fail(
            op,
            ValueError,
            "weights",
            f"shape {list(weights.shape)}, expected {list(query_index.shape[:-1])}",
            "pass one weight per indexer head",
            shown,
        )
    if tuple(sparse_indices.shape[:-1]) != (*query.shape[:-2], 1):
        fail(
            op,
            ValueError,
            "sparse_indices",
            f"shape {list(sparse_indices.shape)}, expected {[*query.shape[:-2], 1, 'K']}",
            "pass the indexer's output",
            shown,
        )
    check_rope_pair(op, query_rope, key_rope, shown)
    if not is_real(scale_value):
        fail(
            op,
            TypeError,
            "scale_value",
            f"expected a real number, got {scale_value!r}",
            "pass the main attention's softmax scale",
            shown,
        )
    check_choice(op, "sparse_mode", sparse_mode, SPARSE_MODES, shown)
    segments(op, layout, query, actual_seq_qlen, "actual_seq_qlen", shown)
    segments(op, layout, key, actual_seq_klen, "actual_seq_klen", shown)


def indexer_kl_loss_reference(
    query,
    key,
    query_index,
    key_index,
    weights,
    sparse_indices,
    softmax_max,
    softmax_sum,
    scale_value,
    *,
    query_rope=None,
    key_rope=None,
    actual_seq_qlen=None,
    actual_seq_klen=None,
    layout="BSND",
    sparse_mode=3,
    head_group=None,
):
    """``(d_query_index, d_key_index, d_weights, loss)`` of ``loss = sum_t KL(p_t || softmax(I_t))``
    over each query's selected (visible) keys: ``p_t`` the main attention's probabilities summed
    over the heads and L1-normalized, ``I_t`` the indexer scores. ``softmax_max`` /
    ``softmax_sum`` are not read: ``p`` is recomputed from query, key and the rope parts.
    ``head_group``: the process group over which the heads are split (tensor parallelism): the
    head sums are all-reduced over it before normalizing. The loss is float32 of shape ``[1]``;
    the gradients take their inputs' dtypes."""
    del softmax_max, softmax_sum
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    q_segments = segments(KL_LOSS, layout, query, actual_seq_qlen, "", ())
    k_segments = segments(KL_LOSS, layout, key, actual_seq_klen, "", ())
    blocks = [
        (q, k, s)
        for q, k in zip(q_segments, k_segments)
        if q[2] and k[2]
        for s in range(0, q[2], QUERY_BLOCK)
    ]
    mains = (query, query_rope, key, key_rope, sparse_indices)
    masses = (
        _block_mass(mains, *block, layout, compute, scale_value, sparse_mode) for block in blocks
    )
    if head_group is not None:  # every block's head sums at once, one all-reduce
        masses = _summed_over(list(masses), head_group)
    with torch.enable_grad():  # it takes its own gradients, in any grad mode
        leaves = [
            t.detach().to(compute).requires_grad_() for t in (query_index, key_index, weights)
        ]
        loss = torch.zeros((), dtype=compute, device=query.device)
        for block, mass in zip(blocks, masses):  # without a group, one block's mass at a time
            loss = loss + _block_kl((*leaves, sparse_indices), mass, *block, layout, sparse_mode)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    d_qi, d_ki, d_w = (g.to(t.dtype) for g, t in zip(grads, (query_index, key_index, weights)))
    return d_qi, d_ki, d_w, loss.detach().float().reshape(1)


def _summed_over(masses: list, group) -> list:
    """``masses`` summed over the ranks of ``group`` (one all-reduce)."""
    if not masses:
        return masses
    flat = torch.cat([m.flatten() for m in masses])
    torch.distributed.all_reduce(flat, group=group)
    return [f.view_as(m) for f, m in zip(flat.split([m.numel() for m in masses]), masses)]


def _visible(chosen, start, n_keys, offset, sparse_mode):
    """One block's chosen key positions ``[blk, K]`` (its first query ``start``), clamped into
    range, and which are visible."""
    keep = (chosen >= 0) & (chosen < n_keys)
    if sparse_mode == 3:
        rows = torch.arange(start, start + chosen.shape[0], device=chosen.device)
        keep &= chosen <= rows[:, None] + offset
    return chosen.clamp(0, n_keys - 1), keep


@torch.no_grad()
def _block_mass(mains, q_seg, k_seg, start, layout, compute, scale_value, sparse_mode):
    """``[blk, K]``: one query block's attention probabilities over its chosen keys, summed over
    this rank's heads (0 where a key is not visible). ``mains``: query, query_rope, key,
    key_rope, sparse_indices."""
    (b, q0, sq), (kb, k0, skv) = q_seg, k_seg
    query, query_rope, key, key_rope, sparse_indices = mains
    rows = slice(start, min(start + QUERY_BLOCK, sq))
    chosen = sequence(sparse_indices, layout, b, q0, sq)[rows, 0].long()
    pos, keep = _visible(chosen, start, skv, skv - sq, sparse_mode)
    logits = 0
    for q, k in ((query, key), (query_rope, key_rope)):
        if q is not None:  # the block's rows and its gathered keys only, in the compute dtype
            q = sequence(q, layout, b, q0, sq)[rows].to(compute)
            k = sequence(k, layout, kb, k0, skv)[:, 0][pos].to(compute)
            logits = logits + torch.einsum("qnd,qmd->qnm", q, k)
    logits = (logits * scale_value).masked_fill(~keep[:, None], float("-inf"))
    return torch.softmax(logits, -1).nan_to_num(0.0).sum(1)


def _block_kl(index, mass, q_seg, k_seg, start, layout, sparse_mode):
    """``sum KL(p || softmax(I))`` of one query block: ``index`` the indexer's query, key,
    weights and the chosen positions, ``mass`` the block's summed attention (``[blk, K]``)."""
    (b, q0, sq), (kb, k0, skv) = q_seg, k_seg
    qi, ki, w, chosen = (
        sequence(t, layout, *seg)
        for t, seg in zip(index, ((b, q0, sq), (kb, k0, skv), (b, q0, sq), (b, q0, sq)))
    )
    rows = slice(start, min(start + QUERY_BLOCK, sq))
    pos, keep = _visible(chosen[rows, 0].long(), start, skv, skv - sq, sparse_mode)
    target = mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)
    scores = torch.einsum("qnd,qmd->qnm", qi[rows], ki[:, 0][pos]).relu()
    scores = torch.einsum("qnm,qn->qm", scores, w[rows]).masked_fill(~keep, float("-inf"))
    log_q = torch.log_softmax(scores, -1).masked_fill(~keep, 0.0)
    log_p = torch.where(target > 0, target, 1).log()
    return (target * (log_p - log_q)).sum()


def sparse_lightning_indexer_grad_kl_loss(
    query,
    key,
    query_index,
    key_index,
    weights,
    sparse_indices,
    softmax_max,
    softmax_sum,
    scale_value,
    *,
    query_rope=None,
    key_rope=None,
    actual_seq_qlen=None,
    actual_seq_klen=None,
    layout="BSND",
    sparse_mode=3,
    head_group=None,
    kernel="auto",
):
    """``torch_npu.npu_sparse_lightning_indexer_grad_kl_loss(...)``: the indexer's KL loss
    against the main attention and its gradients (:func:`indexer_kl_loss_reference`). On the
    NPU, softmax_max / softmax_sum are :func:`sparse_flash_attention`'s statistics.
    ``head_group`` (the plugin's, not torch_npu's): the group the heads are split over; the
    fused kernel sums one rank's heads only, so a group of more than one rank takes the
    reference."""
    args = dict(
        query_rope=query_rope,
        key_rope=key_rope,
        actual_seq_qlen=actual_seq_qlen,
        actual_seq_klen=actual_seq_klen,
        layout=layout,
        sparse_mode=sparse_mode,
    )
    validate_indexer_kl_loss(
        query, key, query_index, key_index, weights, sparse_indices, scale_value, **args
    )
    split = head_group is not None and head_group.size() > 1
    chosen = registry.resolve(
        KL_LOSS,
        kernel,
        device_of(query),
        query=query,
        query_index=query_index,
        query_rope=query_rope,
        sparse_count=sparse_indices.shape[-1],
        heads_split=split,
    ).kernel
    call = (
        query,
        key,
        query_index,
        key_index,
        weights,
        sparse_indices,
        softmax_max,
        softmax_sum,
        scale_value,
    )
    if chosen == "torch_npu":
        args.update(
            lengths_as_tensors(
                query, actual_seq_qlen, actual_seq_klen, ("actual_seq_qlen", "actual_seq_klen")
            )
        )
        return registry.ascend(KL_LOSS)(*call, **args)
    return indexer_kl_loss_reference(*call, **args, head_group=head_group if split else None)
