"""``cp_comm_type="a2a"`` (Ulysses): trade the sequence split for a head split.

An all-to-all (sbhd: point-to-point messages that land each chunk at its natural rows) turns the
local chunks (sbhd ``[s/CP, b, np, hn]``, thd ``[t/CP, np, hn]``) into the whole sequence with 1/CP
of the heads (``[s, b, np/CP, hn]``, ``[t, np/CP, hn]``) in natural order, attention runs as without
CP (the one-process mask arguments), and a second all-to-all brings the output back. Query heads and
KV groups must divide by CP. See docs/context_parallel.md."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_npu.masks import BottomRightCausalMask, FullAttention, TopLeftCausalMask
from mcore_npu.masks.descriptions import layer_window
from mcore_npu.ops import fusion_attention
from mcore_npu.transformer.context_parallel import chunks, rules
from mcore_npu.transformer.context_parallel.thd import thd_get_partitioned_indices


class TokenOrder:
    """How the rank-ordered gathered tokens (dim 0) map to natural order and back (sbhd: whole
    chunks; thd: every packed sequence's own chunks). Also used by the Gated DeltaNet's all-to-all.
    """

    def __init__(self, size: int, device, thd_ends=None, memo=None) -> None:
        self.size, self.packed = size, thd_ends is not None
        if thd_ends is None:
            self.natural, self.ranked = (
                chunks.natural_index(size, device),
                chunks.rank_index(size, device),
            )
        else:
            key = ("cp_a2a", tuple(thd_ends), size, torch.device(device))
            self.natural, self.ranked = chunks.planned(memo, key, lambda: _packed_order(*key[1:]))

    def to_natural(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:  # sbhd: whole chunks
            return chunks.reorder_chunks(x, self.natural, 2 * self.size)
        return x.index_select(0, self.natural)

    def to_ranked(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return chunks.reorder_chunks(x, self.ranked, 2 * self.size)
        return x.index_select(0, self.ranked)


def _packed_order(ends: tuple[int, ...], size: int, device: torch.device):
    """``(natural, ranked)`` token permutations of a packed batch: ``ranked[p]`` is the global token
    at rank-order position p."""
    cu = torch.tensor((0, *ends)) * size  # global padded cu_seqlens, leading 0
    total = cu[-1].item()
    ranked = torch.cat([thd_get_partitioned_indices(cu, total, size, r) for r in range(size)])
    natural = torch.empty_like(ranked)
    natural[ranked] = torch.arange(total)
    return natural.to(device), ranked.to(device)


def _seq_to_heads(x, group, order: TokenOrder):
    """``[t_local, *batch, n, d]`` -> ``[t, *batch, n/CP, d]``, natural token order."""
    if not order.packed:
        return _dense_seq_to_heads(x, group)
    size = dist.get_world_size(group)
    t_local, *batch, n, d = x.shape
    parts = x.reshape(t_local, *batch, size, n // size, d).movedim(-3, 0)  # [CP, t_l, ..., n/CP, d]
    received = chunks.all_to_all(parts, group)  # [CP (source rank), t_l, ..., n/CP, d]
    del parts
    return order.to_natural(received.reshape(size * t_local, *batch, n // size, d))


def _heads_to_seq(x, group, order: TokenOrder):
    """``[t, *batch, n/CP, d]`` (natural order) -> ``[t_local, *batch, n, d]``: the inverse."""
    if not order.packed:
        return _dense_heads_to_seq(x, group)
    size = dist.get_world_size(group)
    t, *batch, n_local, d = x.shape
    ranked = order.to_ranked(x)
    received = chunks.all_to_all(ranked.reshape(size, t // size, *batch, n_local, d), group)
    del ranked
    # [CP (head group), t_l, ..., n/CP, d] -> [t_l, ..., CP, n/CP, d] -> [t_l, ..., n, d]
    return received.movedim(0, -3).reshape(t // size, *batch, size * n_local, d)


def _dense_seq_to_heads(x, group):
    """sbhd ``[s_l, b, n, d]`` (chunks r, 2CP-1-r) -> ``[CP*s_l, b, n/CP, d]`` in natural order;
    only the heads sent to peers are copied besides the output."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    s_l, b, n, d = x.shape
    c, nl = s_l // 2, n // size
    out = x.new_empty(size * s_l, b, nl, d)
    ops = []
    for peer in range(size):
        heads = x[:, :, peer * nl : (peer + 1) * nl]
        if peer == rank:
            for half, chunk in zip((heads[:c], heads[c:]), chunks.chunk_ids(rank, size)):
                out[chunk * c : (chunk + 1) * c].copy_(half)
            continue
        send = heads.contiguous()
        ops += _halves_ops(
            group,
            peer,
            (send[:c], send[c:]),
            [out[k * c : (k + 1) * c] for k in chunks.chunk_ids(peer, size)],
        )
    _run(ops)
    return out


def _dense_heads_to_seq(x, group):
    """The inverse: ``[CP*s_l, b, n/CP, d]`` natural order -> ``[s_l, b, n, d]`` (chunks r,
    2CP-1-r)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    x = x.contiguous()
    s, b, nl, d = x.shape
    s_l = s // size
    c = s_l // 2
    out = x.new_empty(s_l, b, size * nl, d)
    ops, received = [], {}
    for peer in range(size):
        theirs = [x[k * c : (k + 1) * c] for k in chunks.chunk_ids(peer, size)]
        if peer == rank:
            for half, rows in zip(theirs, (slice(0, c), slice(c, s_l))):
                out[rows, :, rank * nl : (rank + 1) * nl].copy_(half)
            continue
        received[peer] = x.new_empty(s_l, b, nl, d)
        ops += _halves_ops(group, peer, theirs, (received[peer][:c], received[peer][c:]))
    _run(ops)
    for peer, buffer in received.items():
        out[:, :, peer * nl : (peer + 1) * nl].copy_(buffer)
    return out


def _halves_ops(group, peer: int, sends, recvs) -> list:
    """Two sends and two receives with ``peer`` (group rank), tagged 0 (early) and 1 (late)."""
    to = dist.get_global_rank(group, peer)
    ops = [dist.P2POp(dist.isend, t, to, group, tag) for tag, t in enumerate(sends)]
    return ops + [dist.P2POp(dist.irecv, t, to, group, tag) for tag, t in enumerate(recvs)]


def _run(ops: list) -> None:
    for request in dist.batch_isend_irecv(ops) if ops else ():
        request.wait()


class SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, order):
        ctx.group, ctx.order = group, order
        return _seq_to_heads(x, group, order)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.order), None, None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, order):
        ctx.group, ctx.order = group, order
        return _heads_to_seq(x, group, order)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.order), None, None


def _mask_kwargs(causal: bool, window, packed: bool, device) -> dict:
    """The one-process mask arguments of the whole (square) sequence; ``window`` is Megatron's
    ``window_size``."""
    within = layer_window("causal" if causal else "no_mask", window)
    if within is None:
        if not causal:
            within = FullAttention()
        else:
            within = BottomRightCausalMask() if packed else TopLeftCausalMask()
    return within.operator_args(device).as_kwargs()


def attention(
    query,
    key,
    value,
    group,
    *,
    heads,
    scale,
    causal,
    kernel,
    keep_prob=1.0,
    thd_ends=None,
    window=None,
    memo=None,
):
    """Context-parallel attention by all-to-all: sbhd ``[s_local, b, np, hn]`` ->
    ``[s_local, b, np * hn]``; with ``thd_ends`` (local padded cumulative ends without a leading 0,
    host ints) thd ``[t_local, np, hn]`` -> ``[t_local, np * hn]``, TND over the global padded
    lengths."""
    size = dist.get_world_size(group)
    rules.check("a2a", size, heads=heads, groups=key.shape[-2])
    packed = thd_ends is not None
    if packed and (not thd_ends or tuple(thd_ends)[-1] != query.shape[0]):
        raise ValueError(
            f"thd_ends: expected the local padded cumulative ends without a leading 0, ending at "
            f"the local token count {query.shape[0]}; got {thd_ends!r}"
        )
    order = TokenOrder(size, query.device, thd_ends, memo)
    q, k, v = (SeqToHeads.apply(t, group, order) for t in (query, key, value))
    kwargs = dict(kernel=kernel, scale=scale, keep_prob=keep_prob)
    kwargs.update(_mask_kwargs(causal, window, packed, query.device))
    if packed:
        ends = [e * size for e in thd_ends]
        kwargs.update(actual_seq_qlen=ends, actual_seq_kvlen=ends)
        out = fusion_attention(q, k, v, heads // size, "TND", **kwargs)  # [t, np/CP, hn]
    else:
        out = fusion_attention(
            q.flatten(2), k.flatten(2), v.flatten(2), heads // size, "SBH", **kwargs
        ).unflatten(-1, (heads // size, -1))
    return HeadsToSeq.apply(out, group, order).flatten(-2)
