"""``torch_npu.npu_rms_norm`` in plain PyTorch: same signature, return convention and refusals::

    x      [*lead, *norm]   float16 | bfloat16 | float32 (float64: reference only), rank 1..8
    gamma  [*norm]          x's dtype; x's trailing dimensions
    y      [*lead, *norm]   x * rstd * gamma, in x's dtype
    rstd   [*lead, 1...1]   rsqrt(mean(x**2 over the norm dims) + epsilon), float32 (float64)

Zero-centred gamma is the caller's business (pass ``1 + gamma``)."""

from __future__ import annotations

import torch

from mcore_npu.ops._checks import check_finite_nonnegative, check_tensor, fail

OP = "npu_rms_norm"
MAX_RANK = 8


def validate_rms_norm(x, gamma, epsilon=1e-06, *, kernel: str = "reference") -> int:
    """Check one call (errors name ``self``, ``gamma`` or ``epsilon``); returns the number of
    normalised (trailing) dimensions."""
    shown = (("self", x), ("gamma", gamma))
    check_tensor(OP, "self", x, kernel, shown)
    check_tensor(OP, "gamma", gamma, kernel, shown)
    trailing = "give gamma the shape of self's trailing (normalised) dimensions"
    if not 1 <= x.dim() <= MAX_RANK:
        problem = f"rank {x.dim()} is outside 1..{MAX_RANK}"
        fix = "reshape the input to at most 8 dimensions (at least 1)"
        fail(OP, ValueError, "self", problem, fix, shown)
    if gamma.dtype != x.dtype:
        problem = f"dtype {gamma.dtype} differs from self's {x.dtype}"
        fail(OP, TypeError, "gamma", problem, "cast gamma to the input's dtype", shown)
    if gamma.device != x.device:
        problem = f"is on {gamma.device} but self is on {x.device}"
        fail(OP, ValueError, "gamma", problem, "move gamma to the input's device", shown)
    if gamma.dim() == 0 or gamma.dim() > x.dim():
        problem = f"rank {gamma.dim()} must lie in 1..{x.dim()} (self's rank)"
        fail(OP, ValueError, "gamma", problem, trailing, shown)
    if tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim() :]):
        expected = list(x.shape[x.dim() - gamma.dim() :])
        problem = f"shape {list(gamma.shape)} is not self's trailing shape {expected}"
        fail(OP, ValueError, "gamma", problem, trailing, shown)
    if gamma.numel() == 0:
        problem = "is empty: nothing to normalise over"
        fail(OP, ValueError, "gamma", problem, "normalise over at least one element", shown)
    check_finite_nonnegative(OP, "epsilon", epsilon)
    return gamma.dim()


def npu_rms_norm(self, gamma, epsilon=1e-06):
    """Root-mean-square norm over gamma's dimensions: ``(y, rstd)``, differentiable."""
    kernel = "reference"
    norm_dims = validate_rms_norm(self, gamma, epsilon, kernel=kernel)
    compute = torch.float64 if self.dtype == torch.float64 else torch.float32
    dims = tuple(range(self.dim() - norm_dims, self.dim()))
    xc = self.to(compute)
    rstd = torch.rsqrt(xc.square().mean(dim=dims, keepdim=True) + epsilon)  # [*lead, 1...1]
    y = (xc * rstd * gamma.to(compute)).to(self.dtype)
    return y, rstd
