"""``chunk_gated_delta_rule``: fla's calling convention, checked, on the chosen kernel.

State per value head ``S [K, V]``: ``S_t = e^{g_t} (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``,
``o_t = S_t^T q_t``. The reference is the chunked form (``mcore_npu.ops.gated_delta.chunked``).

``kernel="auto"`` picks, for NPU tensors: torch_npu's forward-only kernel for calls that need no
gradient (when it takes the shapes), else the trainable fla_npu Ascend C chain (when installed
and it takes the call), else fla's triton-ascend kernel (when installed), else the reference.
Everywhere else it picks the reference.
"""

from __future__ import annotations

import torch

from mcore_npu.ops.gated_delta import fla_npu_chain, kernels
from mcore_npu.ops.gated_delta.checks import validate_rule
from mcore_npu.ops.gated_delta.chunked import chunked_gated_delta_rule
from mcore_npu.ops.gated_delta.norms import l2norm

KERNELS = ("auto", "reference", "fla_npu", "fla", "torch_npu")


def needs_grad(*tensors) -> bool:
    """Whether autograd will want gradients of any of these tensors."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def choose_kernel(kernel: str, q, v, *, grad: bool, initial_state=None,
                  output_final_state=False) -> str:  # fmt: skip
    """The kernel that runs this call (``auto`` resolved; see the module docstring)."""
    if kernel not in KERNELS:
        raise ValueError(f"chunk_gated_delta_rule: kernel: unknown kernel {kernel!r}\n"
                         f"  fix: pass one of {', '.join(KERNELS)} ('auto' picks the Ascend "
                         "kernels for NPU tensors and the reference elsewhere)")  # fmt: skip
    if kernel != "auto":
        return kernel
    if q.device.type != "npu":
        return "reference"
    forward_only = not grad and kernels.torch_npu_rule() is not None
    if forward_only and kernels.torch_npu_unsupported(q, v) is None:
        return "torch_npu"
    chain = fla_npu_chain.available()
    if chain and fla_npu_chain.unsupported(q, v, initial_state, output_final_state) is None:
        return "fla_npu"
    if kernels.fla_rule() is not None:
        return "fla"
    return "reference"


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
        ImportError: an explicitly named Ascend kernel that is not installed.
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
        if grad:
            raise ValueError("chunk_gated_delta_rule: kernel: 'torch_npu' is forward only (no "
                             "derivative) but this call needs gradients\n  fix: use "
                             "kernel='auto', or run it under torch.no_grad()")  # fmt: skip
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
