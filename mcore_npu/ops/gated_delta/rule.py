"""``chunk_gated_delta_rule``: fla's calling convention, checked, on the chosen kernel.

State per value head ``S [K, V]``: ``S_t = e^{g_t} (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``,
``o_t = S_t^T q_t``. The reference is the chunked form (``mcore_npu.ops.gated_delta.chunked``).
"""

from __future__ import annotations

from mcore_npu.ops.gated_delta.chunked import chunked_gated_delta_rule
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
    return chunked_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )  # fmt: skip
