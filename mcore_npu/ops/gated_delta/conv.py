"""Depthwise causal convolution with SiLU, segment-aware for packed sequences."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_npu.ops import registry
from mcore_npu.ops.gated_delta.checks import validate_conv


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, *, cu_seqlens=None) -> torch.Tensor:
    """``silu(conv1d(x))``, left padding ``W - 1``: x ``[B, T, C]``, weight ``[C, 1, W]``
    (Megatron's ``conv1d.weight``) -> ``[B, T, C]``; with ``cu_seqlens`` (B == 1) no tap crosses a
    segment boundary."""
    bounds = validate_conv(x, weight, cu_seqlens)
    registry.resolve("causal_conv1d", "auto", x.device)  # the reference (one warning on an NPU)
    if cu_seqlens is None:
        return _conv(x, weight)
    parts = [_conv(x[:, s:e], weight) for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
    return torch.cat(parts, dim=1)


def _conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    width = weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight, padding=width - 1, groups=x.shape[-1])
    return F.silu(y[..., : x.shape[1]]).transpose(1, 2)
