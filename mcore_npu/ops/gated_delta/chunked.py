"""The chunked gated delta rule in plain PyTorch, with its own backward.

Per value head and chunk (C tokens, positions r, s; S the ``[K, V]`` state entering the chunk):
``gam = cumsum(g)``; ``Gam[r, s] = exp(gam_r - gam_s)`` for s <= r, else 0 (masked *before* the
exp, so only non-positive differences are exponentiated: exact under any decay);
``L = strict_lower(diag(beta) K K^T * Gam)``; ``(I + L) [U | W] = diag(beta) [V | K * e^gam]``.
Then ``V' = U - W S``, ``O = (Q * e^gam) S + (Q K^T * Gam) V'`` and
``S <- e^{gam_C} S + (K * e^{gam_C - gam})^T V'``.

Everything intra-chunk runs batched over ``[B, HV, NC]``; only the state passes through a Python
loop over chunks (NC = T / C steps, two matmuls each). The backward saves the inputs only,
recomputes the intra-chunk terms and the chunk states, runs a reverse scan over chunks for
``dS`` and ends with a reverse cumsum for ``dg``. Accumulation is fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_npu.ops.gated_delta.chunks import ChunkPlan, from_chunks, plan_chunks, to_chunks

DEFAULT_CHUNK = 64


@dataclass
class _Intra:
    """Intra-chunk terms, each ``[B, HV, NC, ...]``: C = chunk, K/V = head dims."""

    gam: torch.Tensor  # [..., C] cumulative log-decay within the chunk
    rel: torch.Tensor  # [..., C, C] Gam: exp(gam_r - gam_s) for s <= r, else 0
    lower: torch.Tensor  # [..., C, C] L (strictly lower)
    u: torch.Tensor  # [..., C, V]
    w: torch.Tensor  # [..., C, K]
    attn: torch.Tensor  # [..., C, C] P = Q K^T * Gam (lower, diagonal included)
    q_dec: torch.Tensor  # [..., C, K] Q * e^gam
    k_out: torch.Tensor  # [..., C, K] K * e^{gam_C - gam}
    to_end: torch.Tensor  # [..., C] e^{gam_C - gam}
    decay: torch.Tensor  # [..., 1, 1] e^{gam_C}


def _intra(q, k, v, g, beta) -> _Intra:
    """q, k ``[..., C, K]``, v ``[..., C, V]``, g, beta ``[..., C]`` (compute dtype)."""
    size = g.shape[-1]
    gam = g.cumsum(-1)
    incl = torch.ones(size, size, dtype=torch.bool, device=g.device).tril()
    rel = (gam[..., :, None] - gam[..., None, :]).masked_fill(~incl, float("-inf")).exp()
    lower = (beta[..., :, None] * (k @ k.mT) * rel).tril(-1)
    e_gam = gam.exp()
    rhs = torch.cat([beta[..., None] * v, (beta * e_gam)[..., None] * k], dim=-1)
    eye = torch.eye(size, dtype=g.dtype, device=g.device)
    solved = torch.linalg.solve_triangular(lower + eye, rhs, upper=False, unitriangular=True)
    u, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    to_end = (gam[..., -1:] - gam).exp()
    return _Intra(
        gam=gam, rel=rel, lower=lower, u=u, w=w, attn=(q @ k.mT) * rel,
        q_dec=q * e_gam[..., None], k_out=k * to_end[..., None], to_end=to_end,
        decay=gam[..., -1].exp()[..., None, None],
    )  # fmt: skip


def _forward_scan(t: _Intra, inits: list[torch.Tensor], plan: ChunkPlan):
    """States entering each chunk ``[B, HV, NC, K, V]``, V' ``[B, HV, NC, C, V]``, finals."""
    b, hv, nc, _, dk = t.w.shape
    states = t.u.new_empty(b, hv, nc, dk, t.u.shape[-1])
    new_values = torch.empty_like(t.u)
    finals = list(inits)  # an empty segment ends where it starts
    firsts, lasts = plan.first_chunks, plan.last_chunks
    state = None
    for j in range(nc):
        if j in firsts:
            state = inits[firsts[j]]
        states[:, :, j] = state
        new_values[:, :, j] = t.u[:, :, j] - t.w[:, :, j] @ state
        state = t.decay[:, :, j] * state + t.k_out[:, :, j].mT @ new_values[:, :, j]
        if j in lasts:
            finals[lasts[j]] = state
    return states, new_values, finals


def _backward_scan(t: _Intra, d_out, d_finals, plan: ChunkPlan):
    """dS after each chunk ``[B, HV, NC, K, V]``, dV' ``[B, HV, NC, C, V]``, d(initial)."""
    b, hv, nc, _, dk = t.w.shape
    dv_ = t.u.shape[-1]
    via_out = t.attn.mT @ d_out  # [..., C, V]
    state_via_out = t.q_dec.mT @ d_out  # [..., K, V]
    d_next = t.u.new_empty(b, hv, nc, dk, dv_)
    d_new_values = torch.empty_like(t.u)
    d_inits = [d if d is not None else t.u.new_zeros(b, hv, dk, dv_) for d in d_finals]
    firsts, lasts = plan.first_chunks, plan.last_chunks
    d_state = None
    for j in reversed(range(nc)):
        if j in lasts:
            d_final = d_finals[lasts[j]]
            d_state = t.u.new_zeros(b, hv, dk, dv_) if d_final is None else d_final
        d_next[:, :, j] = d_state
        d_new_values[:, :, j] = via_out[:, :, j] + t.k_out[:, :, j] @ d_state
        d_state = (state_via_out[:, :, j] + t.decay[:, :, j] * d_state
                   - t.w[:, :, j].mT @ d_new_values[:, :, j])  # fmt: skip
        if j in firsts:
            d_inits[firsts[j]] = d_state
    return d_next, d_new_values, d_inits


def _rows_minus_cols(e: torch.Tensor) -> torch.Tensor:
    """d gam from a term ``e[r, s]`` that multiplies ``exp(gam_r - gam_s)``."""
    return e.sum(-1) - e.sum(-2)


def _input_grads(t: _Intra, q, k, v, beta, states, new_values, d_out, d_next, d_new_values):
    """Gradients of the chunked q, k, v, g, beta (compute dtype, chunk layout)."""
    d_q_dec = d_out @ states.mT
    d_attn_raw = d_out @ new_values.mT  # d P
    d_attn = d_attn_raw * t.rel  # d (Q K^T), lower triangle (Gam masks it)
    d_k_out = new_values @ d_next.mT
    d_decay = (states * d_next).sum((-2, -1))  # [..] d/d e^{gam_C}
    d_w = -(d_new_values @ states.mT)
    eye = torch.eye(t.rel.shape[-1], dtype=t.rel.dtype, device=t.rel.device)
    d_rhs = torch.linalg.solve_triangular(
        t.lower.mT + eye, torch.cat([d_new_values, d_w], -1), upper=True, unitriangular=True
    )
    d_bv, d_bk = d_rhs.split([v.shape[-1], k.shape[-1]], dim=-1)
    d_lower = -(d_bv @ t.u.mT + d_bk @ t.w.mT).tril(-1)
    d_lower_rel = d_lower * t.rel
    e_gam = t.gam.exp()
    k_dec = k * e_gam[..., None]
    beta_dl = beta[..., :, None] * d_lower_rel
    d_q = d_q_dec * e_gam[..., None] + d_attn @ k
    d_k = (d_attn.mT @ q + beta_dl @ k + beta_dl.mT @ k + d_k_out * t.to_end[..., None]
           + beta[..., None] * d_bk * e_gam[..., None])  # fmt: skip
    d_v = beta[..., None] * d_bv
    d_beta = (d_bv * v).sum(-1) + (d_bk * k_dec).sum(-1) + (d_lower_rel * (k @ k.mT)).sum(-1)
    d_k_out_sum = (d_k_out * t.k_out).sum(-1)  # [..., C]
    d_gam = ((d_q_dec * t.q_dec).sum(-1) + beta * (d_bk * k_dec).sum(-1)
             + _rows_minus_cols(d_attn_raw * t.attn) + _rows_minus_cols(d_lower * t.lower)
             - d_k_out_sum)  # fmt: skip
    d_gam[..., -1] += d_k_out_sum.sum(-1) + d_decay * t.decay[..., 0, 0]
    d_g = d_gam.flip(-1).cumsum(-1).flip(-1)
    return d_q, d_k, d_v, d_g, d_beta


@dataclass(frozen=True)
class _Meta:
    scale: float
    plan: ChunkPlan
    groups: int
    want_final: bool


def _prepare(q, k, v, g, beta, meta: _Meta, compute: torch.dtype):
    """Token tensors -> chunk tensors in the compute dtype, q/k repeated to the value heads."""
    q = q.repeat_interleave(meta.groups, dim=2) if meta.groups > 1 else q
    k = k.repeat_interleave(meta.groups, dim=2) if meta.groups > 1 else k
    qc = to_chunks(q.to(compute), meta.plan) * meta.scale
    kc = to_chunks(k.to(compute), meta.plan)
    vc = to_chunks(v.to(compute), meta.plan)
    gc = to_chunks(g.to(compute), meta.plan)
    bc = to_chunks(beta.to(compute), meta.plan)
    return qc, kc, vc, gc, bc


class ChunkedGatedDelta(torch.autograd.Function):
    """``(o, final)`` of the chunked rule; its backward recomputes and scans in reverse."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, meta: _Meta):
        compute = _compute_dtype(q, k, v)
        qc, kc, vc, gc, bc = _prepare(q, k, v, g, beta, meta, compute)
        t = _intra(qc, kc, vc, gc, bc)
        inits = _state_inits(initial_state, meta, vc, kc.shape[-1])
        states, new_values, finals = _forward_scan(t, inits, meta.plan)
        out = t.q_dec @ states + t.attn @ new_values
        ctx.meta = meta
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.set_materialize_grads(False)
        final = torch.cat(finals, dim=0) if meta.want_final else None
        return from_chunks(out, meta.plan).to(v.dtype), final

    @staticmethod
    def backward(ctx, d_o, d_final):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        meta = ctx.meta
        compute = _compute_dtype(q, k, v)
        qc, kc, vc, gc, bc = _prepare(q, k, v, g, beta, meta, compute)
        t = _intra(qc, kc, vc, gc, bc)
        inits = _state_inits(initial_state, meta, vc, kc.shape[-1])
        states, new_values, _ = _forward_scan(t, inits, meta.plan)
        d_out = torch.zeros_like(vc) if d_o is None else to_chunks(d_o.to(compute), meta.plan)
        d_finals = [None] * len(meta.plan.segments)
        if d_final is not None:
            d_finals = list(d_final.to(compute).split(d_final.shape[0] // len(d_finals), dim=0))
        d_next, d_new_values, d_inits = _backward_scan(t, d_out, d_finals, meta.plan)
        grads = _input_grads(t, qc, kc, vc, bc, states, new_values, d_out, d_next, d_new_values)
        d_q, d_k, d_v, d_g, d_beta = (from_chunks(x, meta.plan) for x in grads)
        d_q = _sum_groups(d_q * meta.scale, meta.groups).to(q.dtype)
        d_k = _sum_groups(d_k, meta.groups).to(k.dtype)
        d_init = None
        if initial_state is not None and ctx.needs_input_grad[5]:
            d_init = torch.cat(d_inits, dim=0).to(initial_state.dtype)
        return d_q, d_k, d_v.to(v.dtype), d_g.to(g.dtype), d_beta.to(beta.dtype), d_init, None


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _state_inits(initial_state, meta: _Meta, vc: torch.Tensor, dk: int) -> list[torch.Tensor]:
    """The state each segment starts from, ``[B, HV, K, V]`` in the compute dtype."""
    b, hv = vc.shape[:2]
    count = len(meta.plan.segments)
    if initial_state is None:
        return [vc.new_zeros(b, hv, dk, vc.shape[-1])] * count
    init = initial_state.to(vc.dtype)
    return [init] if count == 1 else list(init.split(1, dim=0))


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, T, HV, D]`` -> ``[B, T, H, D]``: sum the value heads that share a q/k head."""
    if groups == 1:
        return x
    b, t, hv, d = x.shape
    return x.view(b, t, hv // groups, groups, d).sum(3)


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
