"""``rotary_mul``: ``npu_rotary_mul`` (fused RoPE) on the kernel the registry picks, validated
first. A torch_npu without ``rotary_mode`` (6.0.x) is found by its signature (``ops.probes``)."""

from __future__ import annotations

import torch

from mcore_npu.ops import registry, rotary
from mcore_npu.ops.probes import rotary_mul_takes_mode

__all__ = ["rotary_mul", "rotary_mul_takes_mode"]


def rotary_mul(x, r1, r2, rotary_mode="half", *, kernel="auto") -> torch.Tensor:
    """``npu_rotary_mul(x, r1, r2, rotary_mode)``: x [A, B, C, D] -> [A, B, C, D], r1 = cos,
    r2 = sin (S11D for SBND); a torch_npu without ``rotary_mode`` gets ``(x, r1, r2)`` ("half")."""
    device = getattr(x, "device", torch.device("cpu"))
    head_dim = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else None
    facts = dict(rotary_mode=rotary_mode, head_dim=head_dim)
    chosen = registry.resolve("rotary_mul", kernel, device, **facts).kernel
    rotary.validate_rotary_mul(x, r1, r2, rotary_mode, kernel=chosen)
    if chosen != "torch_npu":
        return rotary.npu_rotary_mul(x, r1, r2, rotary_mode)
    op = registry.ascend("rotary_mul")
    if rotary_mul_takes_mode(op):
        return op(x, r1, r2, rotary_mode=rotary_mode)
    return op(x, r1, r2)
