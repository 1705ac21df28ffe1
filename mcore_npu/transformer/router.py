"""A ``TopKRouter`` whose gating needs no Transformer Engine, for the ``router`` slot of MoE layers.

Why: megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` inside a ``try`` whose
``except ImportError`` only sets ``HAVE_TE = False``; ``RouterGatingLinearFunction.forward`` then
evaluates ``te_general_gemm is not None`` and raises ``NameError`` on every machine without TE
(Ascend without MindSpeed's TE shims, CPUs). Which releases have the bug is stated, and checked
against the installed one, in ``tests/transformer/test_router.py``.

``NPUTopKRouter`` replaces only ``gating``: ``logits = input @ weight.T (+ bias)`` computed in
``config.moe_router_dtype`` (``"fp32"`` / ``"fp64"``; None: the input's dtype) with a plain
matmul, through an autograd function that, like Megatron's, keeps the input and weight in their
own dtype for backward (no saved high-precision copies) and returns gradients in those dtypes.
Top-k, the score function (softmax / sigmoid), group-limited top-k, the top-k scaling factor,
aux losses, expert bias and capacity are Megatron's ``TopKRouter``.

``_apply_expert_bias`` (the expert-bias token count, ``moe_router_enable_expert_bias``) is
Megatron's own function run eagerly. megatron-core 0.16.1 decorates it with ``@jit_fuser``
(``router.py``, ``TopKRouter._apply_expert_bias``), which is ``torch.compile`` on torch >= 2.2:
the first call of every new token count compiles the one-line ``local_tokens_per_expert +=
routing_map.sum(0)`` through dynamo and inductor (measured on this project's 2-core CPU: 3 to 13
s per compilation, against 0.01 s eager) and needs a C++ toolchain. Here the undecorated function
(``inspect.unwrap``: what ``torch.compile`` wraps) runs as is: the same statement, the same
counts. Megatron's ``finalize_model_grads`` then updates ``expert_bias`` from them
(``get_updated_expert_bias``) as for its own router. megatron-core 0.15 has no such method: its
``routing`` counts inline, without ``jit_fuser``, and never calls the override below.

Nothing is patched; the weight is not moved between devices (the model is placed as a whole).
"""

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
    """Megatron's ``TopKRouter`` with a TE-free gating matmul (see the module docstring).

    Takes what the ``router`` slot passes (``config``, ``pg_collection``); parameter names
    (``weight``, ``bias``, ``expert_bias``) are ``TopKRouter``'s, so checkpoints are unchanged.
    """

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Router logits ``[S, B, E]`` (or ``[T, E]``) in the router dtype, from ``[S, B, H]``."""
        dtype = ROUTER_DTYPES.get(self.config.moe_router_dtype, input.dtype)
        return _GatingLinear.apply(input, self.weight, self.bias, dtype)

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask=None) -> None:
        """Megatron's count for the expert-bias update, eagerly: ``local_tokens_per_expert [E]
        += routing_map [T, E] .sum(0)`` when ``moe_router_enable_expert_bias`` and grad mode are
        on (``padding_mask`` as Megatron's: True = padding)."""
        _MEGATRON_APPLY_EXPERT_BIAS(self, routing_map, padding_mask)
