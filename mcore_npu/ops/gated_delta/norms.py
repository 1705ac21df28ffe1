"""The two norms around the gated delta rule."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x**2, -1) + eps)`` computed in fp32, returned in x's dtype.

    x: ``[..., D]``. This is MindSpeed's ``use_naive_l2norm`` and fla's in-kernel l2norm.
    """
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6):
    """The GDN output norm: ``weight * rmsnorm(x) * silu(z)`` per value head.

    x, z: ``[..., V]``; weight: ``[V]`` (not zero-centred: it starts at 1). The statistics run in
    fp32; ``rmsnorm(x)`` is cast to x's dtype before the weight, the gate runs in fp32.
    """
    xf = x.float()
    x_hat = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * x_hat * F.silu(z.float())).to(x.dtype)
