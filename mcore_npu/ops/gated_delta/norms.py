"""The two norms around the gated delta rule."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_npu.ops import registry
from mcore_npu.ops._checks import check_finite_nonnegative, check_tensor, fail


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x**2, -1) + eps)`` in fp32, in x's dtype (MindSpeed's naive l2norm)."""
    check_tensor("l2norm", "x", x, "reference")
    check_finite_nonnegative("l2norm", "eps", eps)
    registry.resolve("l2norm", "auto", x.device)  # the reference (one warning on an NPU)
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """``weight * rmsnorm(x) * silu(z)`` per value head: x, z ``[..., V]``, weight ``[V]`` (not
    zero-centred); ``rmsnorm(x)`` cast to x's dtype before the weight, the gate in fp32."""
    _check_gated(x, z, weight, eps)
    registry.resolve("gated_rms_norm", "auto", x.device)  # the reference (one warning on an NPU)
    xf = x.float()
    x_hat = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * x_hat * F.silu(z.float())).to(x.dtype)


def _check_gated(x, z, weight, eps) -> None:
    op, shown = "gated_rms_norm", (("x", x), ("z", z), ("weight", weight))
    for name, t in shown:
        check_tensor(op, name, t, "reference", shown)
    if z.shape != x.shape:
        problem = f"shape {list(z.shape)} differs from x's {list(x.shape)}"
        fail(op, ValueError, "z", problem, "pass the gate z with x's shape [..., V]", shown)
    if weight.shape != x.shape[-1:]:
        problem = f"shape {list(weight.shape)}, expected [{x.shape[-1]}] (x's last dimension)"
        fail(op, ValueError, "weight", problem, "pass out_norm.weight [V]", shown)
    check_finite_nonnegative(op, "eps", eps)
