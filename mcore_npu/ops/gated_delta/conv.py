"""Depthwise causal convolution with SiLU, segment-aware for packed sequences."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_npu.ops import registry
from mcore_npu.ops.gated_delta.checks import validate_conv


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias=None, *, cu_seqlens=None, kernel: str = "auto"
):
    """``silu(conv1d(x) + bias)``, left padding ``W - 1``: x ``[B, T, C]``, weight ``[C, 1, W]``
    (Megatron's ``conv1d.weight``), bias ``[C]`` or None -> ``[B, T, C]``; with ``cu_seqlens``
    (B == 1) no tap crosses a segment boundary. On an Ascend 950, ``auto`` takes torch_npu's
    ``npu_masked_causal_conv1d`` for width 3 in fp16 / bf16 without gradients (the bias added
    after it)."""
    bounds = validate_conv(x, weight, cu_seqlens, bias)
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    facts = dict(width=weight.shape[-1], dtype=str(x.dtype).removeprefix("torch."), grad=grad)
    choice = registry.resolve("causal_conv1d", kernel, x.device, **facts).kernel
    conv = _npu_conv if choice == "torch_npu" else _conv
    if cu_seqlens is None:
        return conv(x, weight, bias)
    pairs = zip(bounds[:-1], bounds[1:], strict=True)
    return torch.cat([conv(x[:, s:e], weight, bias) for s, e in pairs], dim=1)


def _conv(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    width = weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight, bias, padding=width - 1, groups=x.shape[-1])
    return F.silu(y[..., : x.shape[1]]).transpose(1, 2)


def _npu_conv(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """torch_npu's kernel: x ``[S, B, C]``, weight ``[W, C]`` (tap W-1 on the current token)."""
    op = registry.ascend("causal_conv1d", "torch_npu")
    y = op(x.transpose(0, 1), weight[:, 0, :].t()).transpose(0, 1)
    return F.silu(y if bias is None else y + bias)
