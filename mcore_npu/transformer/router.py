"""``NPUTopKRouter``: a ``TopKRouter`` whose gating needs no Transformer Engine (the ``router``
slot).

megatron-core's own gating raises ``NameError`` without TE (its ``te_general_gemm`` is never bound).
Only ``gating`` is replaced: ``logits = input @ weight.T (+ bias)`` in ``config.moe_router_dtype``
with a plain matmul, gradients in the operands' dtypes. Everything else (top-k, score function,
groups, aux losses, expert bias, capacity) is Megatron's; the expert-bias token count runs
Megatron's function without its ``torch.compile`` wrapper. Nothing is patched. See docs/moe.md."""

from __future__ import annotations

import inspect

import torch
from megatron.core.transformer.moe.router import TopKRouter

from mcore_npu.transformer import megatron_features

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}

_MEGATRON_APPLY_EXPERT_BIAS = (
    inspect.unwrap(TopKRouter._apply_expert_bias)
    if megatron_features.has("router_expert_bias")
    else None  # megatron-core 0.15: ``routing`` counts inline, no method to call or replace
)
"""Megatron's ``TopKRouter._apply_expert_bias`` without its ``@jit_fuser`` (torch.compile) wrapper."""


class _GatingLinear(torch.autograd.Function):
    """``x [*, H] @ w [E, H].T (+ b [E])`` in ``dtype``; gradients in the operands' dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        ctx.save_for_backward(x, weight, bias)
        ctx.dtype = dtype
        flat = x.reshape(-1, x.shape[-1]).to(dtype)  # [T, H]
        out = flat @ weight.to(dtype).t()  # [T, E]
        if bias is not None:
            out = out + bias.to(dtype)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        grad = grad_out.reshape(-1, weight.shape[0]).to(ctx.dtype)  # [T, E]
        grad_x = (grad @ weight.to(ctx.dtype)).to(x.dtype).view(x.shape)
        grad_w = (grad.t() @ x.reshape(-1, x.shape[-1]).to(ctx.dtype)).to(weight.dtype)
        grad_b = grad.sum(0).to(bias.dtype) if bias is not None else None
        return grad_x, grad_w, grad_b, None


class NPUTopKRouter(TopKRouter):
    """Megatron's ``TopKRouter`` with a TE-free gating matmul; ``TopKRouter``'s parameter names."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Router logits ``[S, B, E]`` (or ``[T, E]``) in the router dtype, from ``[S, B, H]``."""
        dtype = ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        return _GatingLinear.apply(input, self.weight, self.bias, dtype)

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask=None) -> None:
        """Megatron's count for the expert-bias update, eagerly: ``local_tokens_per_expert [E] +=
        routing_map [T, E] .sum(0)`` (``padding_mask``: True = padding)."""
        _MEGATRON_APPLY_EXPERT_BIAS(self, routing_map, padding_mask)
