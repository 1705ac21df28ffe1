"""``torch_npu.npu_rms_norm`` in plain PyTorch: same signature, return convention and refusals.

``npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)``::

    x      [*lead, *norm]   float16 | bfloat16 | float32 (float64: reference only), rank 1..8
    gamma  [*norm]          same dtype as x; its shape is x's trailing dimensions
    y      [*lead, *norm]   x * rstd * gamma, in x's dtype
    rstd   [*lead, 1...1]   rsqrt(mean(x**2 over the norm dims) + epsilon), float32 (float64 for
                            float64 x), x's shape with the normalised dimensions kept as size 1

The statistics are computed in float32 (float64 for float64 input) whatever x's dtype, and y is
cast back at the end. Megatron's RMSNorm ``weight`` is ``gamma``; zero-centred gamma (weight used
= 1 + gamma) is the caller's business (pass ``1 + gamma``).
"""

from __future__ import annotations

import torch

from mcore_npu.ops._checks import check_finite_nonnegative, check_tensor, fail

OP = "npu_rms_norm"
MAX_RANK = 8


def validate_rms_norm(x, gamma, epsilon=1e-06, *, kernel: str = "reference") -> int:
    """Check one call; returns the number of normalised (trailing) dimensions.

    Raises:
        TypeError, ValueError: naming the argument (``self``, ``gamma`` or ``epsilon``).
    """
    shown = (("self", x), ("gamma", gamma))
    check_tensor(OP, "self", x, kernel, shown)
    check_tensor(OP, "gamma", gamma, kernel, shown)
    if not 1 <= x.dim() <= MAX_RANK:
        fail(OP, ValueError, "self", f"rank {x.dim()} is outside 1..{MAX_RANK}",
             "reshape the input to at most 8 dimensions (at least 1)", shown)  # fmt: skip
    if gamma.dtype != x.dtype:
        fail(OP, TypeError, "gamma", f"dtype {gamma.dtype} differs from self's {x.dtype}",
             "cast gamma to the input's dtype", shown)  # fmt: skip
    if gamma.device != x.device:
        fail(OP, ValueError, "gamma", f"is on {gamma.device} but self is on {x.device}",
             "move gamma to the input's device", shown)  # fmt: skip
    if gamma.dim() == 0 or gamma.dim() > x.dim():
        fail(OP, ValueError, "gamma", f"rank {gamma.dim()} must lie in 1..{x.dim()} (self's rank)",
             "give gamma the shape of self's trailing (normalised) dimensions", shown)  # fmt: skip
    if tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim() :]):
        fail(OP, ValueError, "gamma", f"shape {list(gamma.shape)} is not self's trailing shape "
             f"{list(x.shape[x.dim() - gamma.dim():])}",
             "give gamma the shape of self's trailing (normalised) dimensions", shown)  # fmt: skip
    if gamma.numel() == 0:
        fail(OP, ValueError, "gamma", "is empty: nothing to normalise over",
             "normalise over at least one element", shown)  # fmt: skip
    check_finite_nonnegative(OP, "epsilon", epsilon)
    return gamma.dim()


def npu_rms_norm(self, gamma, epsilon=1e-06):
    """Root-mean-square norm over gamma's dimensions; returns ``(y, rstd)`` (see module doc).

    Differentiable through autograd (the real kernel has its own backward that reuses rstd).

    Example::

        >>> y, rstd = npu_rms_norm(torch.ones(2, 4), torch.full((4,), 2.0))
        >>> torch.allclose(y, torch.full((2, 4), 2.0)), rstd.shape, rstd.dtype
        (True, torch.Size([2, 1]), torch.float32)
    """
    kernel = "reference"
    norm_dims = validate_rms_norm(self, gamma, epsilon, kernel=kernel)
    compute = torch.float64 if self.dtype == torch.float64 else torch.float32
    dims = tuple(range(self.dim() - norm_dims, self.dim()))
    xc = self.to(compute)
    rstd = torch.rsqrt(xc.square().mean(dim=dims, keepdim=True) + epsilon)  # [*lead, 1...1]
    y = (xc * rstd * gamma.to(compute)).to(self.dtype)
    return y, rstd
