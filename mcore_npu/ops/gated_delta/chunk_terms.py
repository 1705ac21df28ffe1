"""The per-chunk terms of the chunked gated delta rule and their gradients.

One chunk of C tokens per value head (leading dims ``[B, HV]``); positions r, s in the chunk;
S the ``[K, V]`` state entering it. ``gam = cumsum(g)``; ``Gam[r, s] = exp(gam_r - gam_s)``
for s <= r, else 0 (masked *before* the exp: only non-positive differences are exponentiated,
exact under any decay); ``L = strict_lower(diag(beta) K K^T * Gam)``;
``(I + L) [U | W] = diag(beta) [V | K * e^gam]`` (one triangular solve). Then
``V' = U - W S``, ``O = (Q * e^gam) S + (Q K^T * Gam) V'`` and
``S <- e^{gam_C} S + (K * e^{gam_C - gam})^T V'``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Intra:
    """The terms of one chunk, each ``[B, HV, ...]``: C = chunk, K/V = head dims."""

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


def intra(q, k, v, g, beta) -> Intra:
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
    attn, q_dec, k_out = (q @ k.mT) * rel, q * e_gam[..., None], k * to_end[..., None]
    decay = gam[..., -1].exp()[..., None, None]
    return Intra(gam, rel, lower, u, w, attn, q_dec, k_out, to_end, decay)


def _rows_minus_cols(e: torch.Tensor) -> torch.Tensor:
    """d gam from a term ``e[r, s]`` that multiplies ``exp(gam_r - gam_s)``."""
    return e.sum(-1) - e.sum(-2)


def input_grads(t: Intra, q, k, v, beta, states, new_values, d_out, d_next, d_new_values):
    """Gradients of one chunk's q (scaled), k, v, g, beta, given S entering the chunk
    (``states``), V' (``new_values``), dO, dS leaving it (``d_next``) and dV'."""
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
    d_k = d_attn.mT @ q + beta_dl @ k + beta_dl.mT @ k + d_k_out * t.to_end[..., None]
    d_k = d_k + beta[..., None] * d_bk * e_gam[..., None]
    d_v = beta[..., None] * d_bv
    d_beta = (d_bv * v).sum(-1) + (d_bk * k_dec).sum(-1) + (d_lower_rel * (k @ k.mT)).sum(-1)
    d_k_out_sum = (d_k_out * t.k_out).sum(-1)  # [..., C]
    d_gam = (d_q_dec * t.q_dec).sum(-1) + beta * (d_bk * k_dec).sum(-1)
    d_gam = d_gam + _rows_minus_cols(d_attn_raw * t.attn) + _rows_minus_cols(d_lower * t.lower)
    d_gam = d_gam - d_k_out_sum
    d_gam[..., -1] += d_k_out_sum.sum(-1) + d_decay * t.decay[..., 0, 0]
    d_g = d_gam.flip(-1).cumsum(-1).flip(-1)
    return d_q, d_k, d_v, d_g, d_beta
