"""``chunk_gated_delta_rule``: fla's calling convention, checked, on the kernel the registry picks.

State per value head ``S [K, V]``: ``S_t = e^{g_t} (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``,
``o_t = S_t^T q_t``. The reference is the chunked form (``mcore_npu.ops.gated_delta.chunked``);
the Ascend kernels, in ``auto``'s order: torch_npu's forward-only kernel (calls that need no
gradient), the fla_npu Ascend C chain, fla's triton-ascend kernel.
"""

from __future__ import annotations

import torch

from mcore_npu.ops import registry
from mcore_npu.ops.gated_delta import fla_npu_chain, kernels
from mcore_npu.ops.gated_delta.checks import validate_rule
from mcore_npu.ops.gated_delta.chunked import chunked_gated_delta_rule
from mcore_npu.ops.gated_delta.norms import l2norm

OP = "chunk_gated_delta_rule"
KERNELS = registry.operator(OP).kernel_names


def needs_grad(*tensors) -> bool:
    """Whether autograd will want gradients of any of these tensors."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def choose_kernel(
    kernel: str, q, v, *, grad: bool, initial_state=None, output_final_state=False
) -> str:
    """The kernel that runs this call: the registry's answer for these facts."""
    facts = dict(grad=grad, q=q, v=v, initial_state=initial_state)
    facts["output_final_state"] = output_final_state
    return registry.resolve(OP, kernel, q.device, **facts).kernel


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
    kernel="auto",
):
    """fla's ``chunk_gated_delta_rule``; ``kernel`` is one of ``KERNELS``.

    q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g (log-decay, <= 0), beta: ``[B, T, HV]``;
    HV a multiple of H (value head h reads q/k head ``h // (HV // H)``); scale defaults to
    ``K ** -0.5``; initial_state ``[B or N, HV, K, V]``; cu_seqlens int ``[N + 1]`` (B == 1,
    every segment starts from its own initial state, zero by default). Returns
    ``o [B, T, HV, V]`` in v's dtype and the fp32 final state ``[B or N, HV, K, V]`` (or None).
    """
    grad = needs_grad(q, k, v, g, beta, initial_state)
    state = dict(initial_state=initial_state, output_final_state=output_final_state)
    chosen = "reference"
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor):
        chosen = choose_kernel(kernel, q, v, grad=grad, **state)
    options = dict(cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    bounds = validate_rule(q, k, v, g, beta, scale=scale, **state, **options, kernel=chosen)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    common = dict(scale=scale, **state)
    l2 = dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if chosen == "torch_npu":
        return kernels.run_torch_npu(q, k, v, g, beta, bounds=bounds, **l2, **common)
    if chosen == "fla":
        return kernels.run_fla(q, k, v, g, beta, cu_seqlens=cu_seqlens, **l2, **common)
    if chosen == "fla_npu":
        segments = dict(bounds=bounds, cu_seqlens=cu_seqlens)
        return fla_npu_chain.run(q, k, v, g, beta, **segments, **l2, **common)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return chunked_gated_delta_rule(q, k, v, g, beta, bounds=bounds, **common)
