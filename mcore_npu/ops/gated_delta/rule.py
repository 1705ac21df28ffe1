"""``chunk_gated_delta_rule``: fla's calling convention, checked, on the kernel the registry picks.

State per value head ``S [K, V]``: ``S_t = e^{g_t} (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``,
``o_t = S_t^T q_t``. The reference is the chunked form (``mcore_npu.ops.gated_delta.chunked``).
The Ascend kernels, in ``auto``'s order (``mcore_npu.ops.registry``): torch_npu's forward-only
kernel (calls that need no gradient, when it takes the shapes), the trainable fla_npu Ascend C
chain, fla's triton-ascend kernel.
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


def choose_kernel(kernel: str, q, v, *, grad: bool, initial_state=None,
                  output_final_state=False) -> str:  # fmt: skip
    """The kernel that runs this call: the registry's answer for these facts."""
    return registry.resolve(OP, kernel, q.device, grad=grad, q=q, v=v,
                            initial_state=initial_state,
                            output_final_state=output_final_state).kernel  # fmt: skip


def chunk_gated_delta_rule(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, use_qk_l2norm_in_kernel=False, kernel="auto",
):  # fmt: skip
    """fla's ``chunk_gated_delta_rule``.

    q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; g (log-decay, <= 0), beta: ``[B, T, HV]``;
    HV a multiple of H (value head h reads q/k head ``h // (HV // H)``); scale defaults to
    ``K ** -0.5``; initial_state ``[B or N, HV, K, V]``; cu_seqlens int ``[N + 1]`` (B == 1,
    every segment starts from its own initial state, zero by default).
    Returns ``o [B, T, HV, V]`` in v's dtype and the fp32 final state ``[B or N, HV, K, V]``
    (or None). ``kernel``: one of ``KERNELS`` (see the module docstring).

    Raises:
        TypeError, ValueError: a bad argument (named, with the value and the fix).
        ImportError, ValueError: an Ascend kernel named by ``kernel`` that is not installed or
            cannot take the call (the registry's policy).
    """
    grad = needs_grad(q, k, v, g, beta, initial_state)
    chosen = "reference"
    if isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor):
        chosen = choose_kernel(kernel, q, v, grad=grad, initial_state=initial_state,
                               output_final_state=output_final_state)  # fmt: skip
    bounds = validate_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, kernel=chosen,
    )  # fmt: skip
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    common = dict(scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state)  # fmt: skip
    if chosen == "torch_npu":
        return kernels.run_torch_npu(q, k, v, g, beta, bounds=bounds,
                                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                     **common)  # fmt: skip
    if chosen == "fla":
        return kernels.run_fla(q, k, v, g, beta, cu_seqlens=cu_seqlens,
                               use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               **common)  # fmt: skip
    if chosen == "fla_npu":
        return fla_npu_chain.run(q, k, v, g, beta, bounds=bounds, cu_seqlens=cu_seqlens,
                                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                 **common)  # fmt: skip
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return chunked_gated_delta_rule(q, k, v, g, beta, bounds=bounds, **common)
