"""``rotary_mul``: ``npu_rotary_mul`` (fused RoPE) on the kernel the registry picks.

The call is validated first (the same checks for both kernels). Older torch_npu releases (6.0.x)
have no ``rotary_mode`` and need D = 128: their signature is probed (``ops.probes.rotary_mul``),
never their version, and such a call is a reason the kernel cannot run it.
"""

from __future__ import annotations

import torch

from mcore_npu.ops import registry, rotary
from mcore_npu.ops.probes import rotary_mul_takes_mode

__all__ = ["rotary_mul", "rotary_mul_takes_mode"]


def rotary_mul(x, r1, r2, rotary_mode="half", *, kernel="auto") -> torch.Tensor:
    """``npu_rotary_mul(x, r1, r2, rotary_mode)``: x [A, B, C, D] -> [A, B, C, D] (RoPE).

    ``r1`` = cos, ``r2`` = sin, broadcastable to x (S11D for SBND). A torch_npu whose operator
    has no ``rotary_mode`` gets ``(x, r1, r2)`` only, which is ``"half"``.
    """
    device = getattr(x, "device", torch.device("cpu"))
    head_dim = x.shape[-1] if isinstance(x, torch.Tensor) and x.dim() else None
    chosen = registry.resolve("rotary_mul", kernel, device, rotary_mode=rotary_mode,
                              head_dim=head_dim).kernel  # fmt: skip
    rotary.validate_rotary_mul(x, r1, r2, rotary_mode, kernel=chosen)
    if chosen != "torch_npu":
        return rotary.npu_rotary_mul(x, r1, r2, rotary_mode)
    op = registry.ascend("rotary_mul")
    if rotary_mul_takes_mode(op):
        return op(x, r1, r2, rotary_mode=rotary_mode)
    return op(x, r1, r2)
