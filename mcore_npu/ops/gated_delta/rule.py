"""The gated delta rule (placeholder: the recurrent form through autograd).

State per value head ``S [K, V]``: ``S_t = e^{g_t} (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``,
``o_t = S_t^T q_t``.
"""

from __future__ import annotations

import torch

from mcore_npu.ops.gated_delta.norms import l2norm


def chunk_gated_delta_rule(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, use_qk_l2norm_in_kernel=False,
):  # fmt: skip
    """fla's ``chunk_gated_delta_rule``.

    q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g (log-decay, <= 0), beta: ``[B, T, HV]``;
    HV a multiple of H (value head h reads q/k head ``h // (HV // H)``); scale defaults to
    ``K ** -0.5``; initial_state ``[B or N, HV, K, V]``; cu_seqlens int ``[N + 1]`` (B == 1).
    Returns ``o [B, T, HV, V]`` in v's dtype and the fp32 final state (or None).
    """
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    groups = v.shape[2] // q.shape[2]
    q = q.repeat_interleave(groups, dim=2).float() * scale
    k = k.repeat_interleave(groups, dim=2).float()
    bounds = [0, q.shape[1]] if cu_seqlens is None else cu_seqlens.tolist()
    outs, finals = [], []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        init = (
            None
            if initial_state is None
            else initial_state[n : n + 1]
            if cu_seqlens is not None
            else initial_state
        )
        o, final = _recurrent(q[:, s:e], k[:, s:e], v[:, s:e].float(), g[:, s:e].float(),
                              beta[:, s:e].float(), init)  # fmt: skip
        outs.append(o)
        finals.append(final)
    o = torch.cat(outs, dim=1).to(v.dtype)
    return o, (torch.cat(finals, dim=0) if output_final_state else None)


def _recurrent(q, k, v, g, beta, init):
    b, t, hv, dk = q.shape
    state = q.new_zeros(b, hv, dk, v.shape[-1]) if init is None else init.float()
    outs = []
    for i in range(t):
        kt, vt = k[:, i], v[:, i]  # [B, HV, K], [B, HV, V]
        state = state * g[:, i].exp()[..., None, None]
        delta = vt - torch.einsum("bhk,bhkv->bhv", kt, state)
        state = state + torch.einsum("bhk,bhv->bhkv", kt * beta[:, i, :, None], delta)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i], state))
    return torch.stack(outs, dim=1), state
