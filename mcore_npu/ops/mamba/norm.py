"""Mamba2's gated RMSNorm over groups of channels, mamba_ssm's ``rmsnorm_fn`` convention:
``norm_before_gate=False`` gates first, ``weight * rms_group(x * silu(z))`` (Mamba2, Megatron,
Nemotron-H); True normalizes first, ``weight * rms_group(x) * silu(z)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_npu.ops import registry
from mcore_npu.ops._checks import check_finite_nonnegative, check_tensor, fail, is_int

OP = "rms_norm_gated"


def rms_norm_gated(x, weight, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """x, z ``[..., N]``, weight ``[N]``; groups of ``group_size`` contiguous channels (None:
    one group). fp32 inside, x's dtype out."""
    validate_rms_norm_gated(x, weight, z, eps, group_size)
    registry.resolve(OP, "auto", x.device)  # the reference (one warning on an NPU)
    y = x.float()
    gate = None if z is None else F.silu(z.float())
    if gate is not None and not norm_before_gate:
        y = y * gate
    size = y.shape[-1] if group_size is None else group_size
    grouped = y.unflatten(-1, (-1, size))
    y = (grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + eps)).flatten(-2)
    y = y * weight.float()
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.to(x.dtype)


def validate_rms_norm_gated(x, weight, z, eps, group_size) -> None:
    """Check one ``rms_norm_gated`` call."""
    shown = [(n, t) for n, t in (("x", x), ("weight", weight), ("z", z)) if t is not None]
    for name, t in shown:
        check_tensor(OP, name, t, "reference", shown)
    channels = x.shape[-1]
    if tuple(weight.shape) != (channels,):
        problem = f"shape {list(weight.shape)}, expected [{channels}] (x's last dimension)"
        fail(OP, ValueError, "weight", problem, "pass the norm's weight [N]", shown)
    if z is not None and z.shape != x.shape:
        problem = f"shape {list(z.shape)} differs from x's {list(x.shape)}"
        fail(OP, ValueError, "z", problem, "pass the gate z with x's shape", shown)
    if group_size is not None and (
        not is_int(group_size) or group_size < 1 or channels % group_size
    ):
        problem = f"{group_size!r} does not divide the {channels} channels"
        fail(
            OP, ValueError, "group_size", problem, "pass N // ngroups, or None for one group", shown
        )
    check_finite_nonnegative(OP, "eps", eps)
