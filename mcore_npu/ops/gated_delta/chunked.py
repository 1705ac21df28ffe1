"""The chunked gated delta rule in plain PyTorch, with its own backward (docs/gdn_ops.md).

The maths of one chunk is in ``mcore_npu.ops.gated_delta.chunk_terms``. The terms of ``BLOCK``
chunks are computed together, then the state passes through them in order, so only one block's
intermediates are alive; results go straight into token-layout buffers. The backward saves the
inputs only: a forward pass recomputes the state entering each chunk (``[B, HV, NC, K, V]``),
then a reverse scan gives each chunk's input gradients. Accumulation in fp32 (fp64 for fp64).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mcore_npu.ops.gated_delta.chunk_terms import Intra, input_grads, intra
from mcore_npu.ops.gated_delta.chunks import ChunkPlan, from_chunks, plan_chunks, to_chunks

DEFAULT_CHUNK = 64
BLOCK = 8
"""Chunks whose terms are computed together (batched solves); bounds the memory alive."""


@dataclass(frozen=True)
class _Meta:
    scale: float
    plan: ChunkPlan
    groups: int
    want_final: bool


class _Chunks:
    """Chunk views of the inputs (``[B, heads, NC, C, ...]``, input dtype) and chunk ``j``
    in the compute dtype: q scaled, q and k repeated to the value heads."""

    def __init__(self, q, k, v, g, beta, meta: _Meta, compute: torch.dtype):
        self.views = [to_chunks(x, meta.plan) for x in (q, k, v, g, beta)]
        self.meta, self.compute = meta, compute

    def __getitem__(self, j):
        """Chunk ``j`` (``[B, HV, C, ...]``) or a slice of chunks (``[B, HV, n, C, ...]``)."""
        q, k, v, g, beta = (x[:, :, j].to(self.compute) for x in self.views)
        if self.meta.groups > 1:
            q, k = (x.repeat_interleave(self.meta.groups, dim=1) for x in (q, k))
        return q * self.meta.scale, k, v, g, beta


def _blocks(count: int, reverse: bool = False):
    """``(first, end)`` chunk ranges of ``BLOCK`` chunks, in order or reversed."""
    starts = list(range(0, count, BLOCK))
    pairs = [(s, min(s + BLOCK, count)) for s in starts]
    return reversed(pairs) if reverse else pairs


def _pick(terms, i: int):
    """Chunk ``i`` of block-batched inputs or terms (index 2 of every tensor)."""
    if isinstance(terms, tuple):
        return tuple(x[:, :, i] for x in terms)
    return Intra(**{f.name: getattr(terms, f.name)[:, :, i] for f in fields(Intra)})


def _buffer(like: torch.Tensor, dtype, plan: ChunkPlan, heads: int, *dims: int) -> torch.Tensor:
    """A ``[B, heads, NC, C, *dims]`` view of a token-major buffer on ``like``'s device, B its
    batch (``from_chunks`` of it is a reshape, no copy)."""
    buf = like.new_empty(like.shape[0], plan.chunks, plan.size, heads, *dims, dtype=dtype)
    return buf.movedim(3, 1)


def _inits(initial_state, meta: _Meta, v: torch.Tensor, dk: int, compute) -> list[torch.Tensor]:
    """The state each segment starts from, ``[B, HV, K, V]`` in the compute dtype."""
    count = len(meta.plan.segments)
    if initial_state is None:
        return [v.new_zeros(v.shape[0], v.shape[2], dk, v.shape[3], dtype=compute)] * count
    init = initial_state.to(compute)
    return [init] if count == 1 else list(init.split(1, dim=0))


def _scan(chunks: _Chunks, inits, plan: ChunkPlan, out=None, states=None):
    """Forward over the chunks; writes O into ``out`` and S entering each chunk into
    ``states`` (either may be None); returns the final state of every segment."""
    finals = list(inits)  # an empty segment ends where it starts
    firsts, lasts = plan.first_chunks, plan.last_chunks
    state = None
    for first, end in _blocks(plan.chunks):
        block = intra(*chunks[first:end])
        for j in range(first, end):
            state = _step(j, _pick(block, j - first), state, inits, firsts, out, states)
            if j in lasts:
                finals[lasts[j]] = state
    return finals


def _step(j, t, state, inits, firsts, out, states):
    """One chunk of the forward scan; returns the state leaving it."""
    if j in firsts:
        state = inits[firsts[j]]
    if states is not None:
        states[:, :, j] = state
    new_values = t.u - t.w @ state
    if out is not None:
        out[:, :, j] = t.q_dec @ state + t.attn @ new_values
    return t.decay * state + t.k_out.mT @ new_values


class ChunkedGatedDelta(torch.autograd.Function):
    """``(o, final)`` of the chunked rule; its backward recomputes and scans in reverse."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, meta: _Meta):
        compute = _compute_dtype(q, k, v)
        out = _buffer(v, compute, meta.plan, v.shape[2], v.shape[3])
        inits = _inits(initial_state, meta, v, q.shape[-1], compute)
        finals = _scan(_Chunks(q, k, v, g, beta, meta, compute), inits, meta.plan, out=out)
        ctx.meta = meta
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.set_materialize_grads(False)
        final = torch.cat(finals, dim=0) if meta.want_final else None
        return from_chunks(out, meta.plan).to(v.dtype), final

    @staticmethod
    def backward(ctx, d_o, d_final):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        meta, plan = ctx.meta, ctx.meta.plan
        compute = _compute_dtype(q, k, v)
        chunks = _Chunks(q, k, v, g, beta, meta, compute)
        b, hv, dk, dv = v.shape[0], v.shape[2], q.shape[-1], v.shape[-1]
        states = v.new_empty(b, hv, plan.chunks, dk, dv, dtype=compute)
        _scan(chunks, _inits(initial_state, meta, v, dk, compute), plan, states=states)
        d_finals = [None] * len(plan.segments)
        if d_final is not None:
            d_finals = list(d_final.to(compute).split(d_final.shape[0] // len(d_finals)))
        grads = _Grads(q, v, g, meta, compute)
        d_inits = _reverse_scan(chunks, states, d_o, d_finals, grads, meta)
        d_init = None
        if initial_state is not None and ctx.needs_input_grad[5]:
            d_init = torch.cat(d_inits, dim=0).to(initial_state.dtype)
        d_inputs = [d.to(x.dtype) for d, x in zip(grads.tokens(plan), (q, k, v, g, beta))]
        return (*d_inputs, d_init, None)


class _Grads:
    """Token-major buffers for dq, dk (q/k heads), dv, dg, dbeta (value heads)."""

    def __init__(self, q, v, g, meta: _Meta, compute):
        h, hv, dk, dv = q.shape[2], v.shape[2], q.shape[3], v.shape[3]
        shapes = ((h, dk), (h, dk), (hv, dv), (hv,), (hv,))
        self.bufs = [_buffer(q, compute, meta.plan, *shape) for shape in shapes]
        self.meta = meta

    def write(self, j: int, d_q, d_k, d_v, d_g, d_beta) -> None:
        d_q = _sum_groups(d_q * self.meta.scale, self.meta.groups)
        d_k = _sum_groups(d_k, self.meta.groups)
        for buf, x in zip(self.bufs, (d_q, d_k, d_v, d_g, d_beta)):
            buf[:, :, j] = x

    def tokens(self, plan: ChunkPlan):
        return [from_chunks(buf, plan) for buf in self.bufs]


def _reverse_scan(chunks: _Chunks, states, d_o, d_finals, grads: _Grads, meta: _Meta):
    """The reverse scan: writes every chunk's input gradients; returns d(initial state)."""
    plan = meta.plan
    d_out_view = None if d_o is None else to_chunks(d_o, plan)
    b, hv, _, dk, dv = states.shape
    d_inits = [d if d is not None else states.new_zeros(b, hv, dk, dv) for d in d_finals]
    d_state = None
    for first, end in _blocks(plan.chunks, reverse=True):
        inputs = chunks[first:end]
        block = intra(*inputs)
        for j in reversed(range(first, end)):
            chunk = (_pick(inputs, j - first), _pick(block, j - first))
            d_state = _reverse_step(
                j, *chunk, d_state, states, d_out_view, d_finals, d_inits, grads
            )
    return d_inits


def _reverse_step(j, inputs, t, d_state, states, d_out_view, d_finals, d_inits, grads):
    """One chunk of the reverse scan; returns dS of the state entering it."""
    plan = grads.meta.plan
    firsts, lasts = plan.first_chunks, plan.last_chunks
    b, hv, _, dk, dv = states.shape
    if j in lasts:
        d_final = d_finals[lasts[j]]
        d_state = states.new_zeros(b, hv, dk, dv) if d_final is None else d_final
    q, k, v, _, beta = inputs
    state = states[:, :, j]
    new_values = t.u - t.w @ state
    if d_out_view is None:
        d_out = torch.zeros_like(new_values)
    else:
        d_out = d_out_view[:, :, j].to(states.dtype)  # the compute dtype
    d_new_values = t.attn.mT @ d_out + t.k_out @ d_state
    d_inputs = input_grads(t, q, k, v, beta, state, new_values, d_out, d_state, d_new_values)
    grads.write(j, *d_inputs)
    d_state = t.q_dec.mT @ d_out + t.decay * d_state - t.w.mT @ d_new_values
    if j in firsts:
        d_inits[firsts[j]] = d_state
    return d_state


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, HV, C, D]`` -> ``[B, H, C, D]``: sum the value heads that share a q/k head."""
    if groups == 1:
        return x
    b, hv, c, d = x.shape
    return x.view(b, hv // groups, groups, c, d).sum(2)


def chunked_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale: float,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    chunk_size: int = DEFAULT_CHUNK,
    bounds: list[int] | None = None,
):
    """The reference on checked inputs, shapes as ``chunk_gated_delta_rule``'s; the final state
    is fp32 (fp64 for fp64 inputs). ``chunk_size`` changes round-off only; ``bounds``
    (``[0, ..., T]``) saves re-reading cu_seqlens from the device.
    """
    tokens = q.shape[1]
    if bounds is None:
        bounds = [0, tokens] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    plan = plan_chunks(tokens, bounds, chunk_size, q.device)
    meta = _Meta(float(scale), plan, v.shape[2] // q.shape[2], bool(output_final_state))
    return ChunkedGatedDelta.apply(q, k, v, g, beta, initial_state, meta)
