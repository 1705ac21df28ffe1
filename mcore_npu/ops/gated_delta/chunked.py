"""The chunked gated delta rule in plain PyTorch, with its own backward.

The maths of one chunk is in ``mcore_npu.ops.gated_delta.chunk_terms``. Chunks run one after
the other in a Python loop (NC = T / C steps): each step computes its chunk's terms, its output
and the state it passes on, so memory holds one chunk's intermediates at a time, never the
whole sequence's (what keeps fwd+bwd at a fraction of an autograd-through-chunks version).
Results are written straight into token-layout buffers.

The backward saves only the inputs. It recomputes the chunk states in a forward pass over the
chunks (keeping S entering each chunk, ``[B, HV, NC, K, V]``), then runs a reverse scan over
the chunks: each step recomputes its chunk's terms, takes dS from the chunk after it, gives the
chunk's input gradients (a reverse cumsum for dg) and dS for the chunk before. Accumulation is
fp32 (fp64 for fp64 inputs); packed segments restart from their own initial state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_npu.ops.gated_delta.chunk_terms import input_grads, intra
from mcore_npu.ops.gated_delta.chunks import ChunkPlan, from_chunks, plan_chunks, to_chunks

DEFAULT_CHUNK = 64


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

    def __getitem__(self, j: int):
        q, k, v, g, beta = (x[:, :, j].to(self.compute) for x in self.views)
        if self.meta.groups > 1:
            q, k = (x.repeat_interleave(self.meta.groups, dim=1) for x in (q, k))
        return q * self.meta.scale, k, v, g, beta


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
    for j in range(plan.chunks):
        if j in firsts:
            state = inits[firsts[j]]
        if states is not None:
            states[:, :, j] = state
        t = intra(*chunks[j])
        new_values = t.u - t.w @ state
        if out is not None:
            out[:, :, j] = t.q_dec @ state + t.attn @ new_values
        state = t.decay * state + t.k_out.mT @ new_values
        if j in lasts:
            finals[lasts[j]] = state
    return finals


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
        d_inits = _reverse_scan(chunks, states, d_o, d_finals, grads, meta, compute)
        d_init = None
        if initial_state is not None and ctx.needs_input_grad[5]:
            d_init = torch.cat(d_inits, dim=0).to(initial_state.dtype)
        d_q, d_k, d_v, d_g, d_beta = grads.tokens(plan)
        return (d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), d_g.to(g.dtype),
                d_beta.to(beta.dtype), d_init, None)  # fmt: skip


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


def _reverse_scan(chunks: _Chunks, states, d_o, d_finals, grads: _Grads, meta: _Meta, compute):
    """The reverse scan: writes every chunk's input gradients; returns d(initial state)."""
    plan = meta.plan
    d_out_view = None if d_o is None else to_chunks(d_o, plan)
    b, hv, _, dk, dv = states.shape
    d_inits = [d if d is not None else states.new_zeros(b, hv, dk, dv) for d in d_finals]
    firsts, lasts = plan.first_chunks, plan.last_chunks
    d_state = None
    for j in reversed(range(plan.chunks)):
        if j in lasts:
            d_final = d_finals[lasts[j]]
            d_state = states.new_zeros(b, hv, dk, dv) if d_final is None else d_final
        q, k, v, g, beta = chunks[j]
        t = intra(q, k, v, g, beta)
        state = states[:, :, j]
        new_values = t.u - t.w @ state
        d_out = (torch.zeros_like(new_values) if d_out_view is None
                 else d_out_view[:, :, j].to(compute))  # fmt: skip
        d_new_values = t.attn.mT @ d_out + t.k_out @ d_state
        grads.write(j, *input_grads(t, q, k, v, beta, state, new_values, d_out, d_state,
                                    d_new_values))  # fmt: skip
        d_state = t.q_dec.mT @ d_out + t.decay * d_state - t.w.mT @ d_new_values
        if j in firsts:
            d_inits[firsts[j]] = d_state
    return d_inits


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, HV, C, D]`` -> ``[B, H, C, D]``: sum the value heads that share a q/k head."""
    if groups == 1:
        return x
    b, hv, c, d = x.shape
    return x.view(b, hv // groups, groups, c, d).sum(2)


def chunked_gated_delta_rule(
    q, k, v, g, beta, *, scale: float, initial_state=None, output_final_state=False,
    cu_seqlens=None, chunk_size: int = DEFAULT_CHUNK, bounds: list[int] | None = None,
):  # fmt: skip
    """The reference on checked inputs (see ``chunk_gated_delta_rule`` for the shapes).

    q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g, beta ``[B, T, HV]``; initial_state
    ``[B or N, HV, K, V]``; cu_seqlens int ``[N + 1]`` (B == 1). Returns ``o [B, T, HV, V]``
    in v's dtype and the final state ``[B or N, HV, K, V]`` (fp32; fp64 for fp64 inputs) or None.
    ``chunk_size`` changes round-off only; ``bounds`` (``[0, ..., T]``) saves re-reading
    cu_seqlens from the device when the caller has it.
    """
    tokens = q.shape[1]
    if bounds is None:
        bounds = [0, tokens] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    plan = plan_chunks(tokens, bounds, chunk_size, q.device)
    meta = _Meta(float(scale), plan, v.shape[2] // q.shape[2], bool(output_final_state))
    return ChunkedGatedDelta.apply(q, k, v, g, beta, initial_state, meta)
