"""``torch_npu.npu_rotary_mul`` in plain PyTorch: same signature, semantics and refusals.

``npu_rotary_mul(input, r1, r2, rotary_mode="half") -> Tensor``::

    input   [A, B, C, D]   4-D (SBND, BSND or BNSD), float16 | bfloat16 | float32
                           (float64: reference only); D even and < 896
    r1, r2  broadcastable to input (e.g. S11D for SBND), input's dtype; r1 = cos, r2 = sin
    out     [A, B, C, D]   input's dtype

- ``"half"``: ``out = r1 * x + r2 * cat(-x2, x1)`` with ``x1, x2`` the two halves of the last
  dim (Megatron's rotate-half RoPE with ``r1 = cos(emb)``, ``r2 = sin(emb)``).
- ``"interleave"``: the pairs ``(x[2i], x[2i+1])`` rotate: ``out = r1 * x + r2 * y`` with
  ``y[2i] = -x[2i+1]``, ``y[2i+1] = x[2i]`` (Megatron's ``rotary_interleaved``; r1/r2 hold each
  angle twice, pairwise).

The batch-like sizes (the 2nd and 3rd dims, B and N of SBND) must each be < 1000, and their
product < 1000 in interleave mode. The arithmetic is exactly Megatron's unfused RoPE in the
input's dtype (the real kernel computes 16-bit inputs in float32).
"""

from __future__ import annotations

import torch

from mcore_npu.ops._checks import check_tensor, fail

OP = "npu_rotary_mul"
ROTARY_MODES = ("half", "interleave")
MAX_HEAD_DIM = 896  # D must be below this
MAX_BATCH = 1000  # each of dims 1 and 2 (B, N of SBND) below this; interleave: their product


def validate_rotary_mul(x, r1, r2, rotary_mode="half", *, kernel: str = "reference") -> None:
    """Check one call as the real operator does (before any kernel runs).

    Raises:
        TypeError, ValueError: naming the argument (``input``, ``r1``, ``r2``, ``rotary_mode``).
    """
    shown = (("input", x), ("r1", r1), ("r2", r2))
    for name, t in shown:
        check_tensor(OP, name, t, kernel, shown)
    if not isinstance(rotary_mode, str) or rotary_mode not in ROTARY_MODES:
        fail(OP, ValueError, "rotary_mode", f"unknown mode {rotary_mode!r}",
             "pass 'half' (Megatron's rotate-half) or 'interleave' (rotary_interleaved)",
             shown)  # fmt: skip
    if x.dim() != 4:
        fail(OP, ValueError, "input", f"rank {x.dim()} is not 4",
             "pass a 4-D tensor (SBND, BSND or BNSD; packed thd as [T, 1, N, D])",
             shown)  # fmt: skip
    _check_sizes(x, rotary_mode, shown)
    for name, r in (("r1", r1), ("r2", r2)):
        _check_angles(name, r, x, shown)


def _check_sizes(x, rotary_mode, shown) -> None:
    d = x.shape[-1]
    if d % 2 or d >= MAX_HEAD_DIM or d == 0:
        fail(OP, ValueError, "input", f"last dim D = {d} must be even, > 0 and < {MAX_HEAD_DIM}",
             "rotate an even number of channels below 896 (slice the rotary part first)",
             shown)  # fmt: skip
    b, n = x.shape[1], x.shape[2]
    if b >= MAX_BATCH or n >= MAX_BATCH:
        fail(OP, ValueError, "input", f"dims 1 and 2 are {b} and {n}; each must be < {MAX_BATCH}",
             "split the call along dim 1 or 2 into pieces below 1000", shown)  # fmt: skip
    if rotary_mode == "interleave" and b * n >= MAX_BATCH:
        fail(OP, ValueError, "input", f"interleave mode needs dim1 * dim2 < {MAX_BATCH}, got "
             f"{b} * {n} = {b * n}", "split the call along dim 1 or 2 (or use 'half')",
             shown)  # fmt: skip


def _check_angles(name, r, x, shown) -> None:
    if r.dtype != x.dtype:
        fail(OP, TypeError, name, f"dtype {r.dtype} differs from input's {x.dtype}",
             f"cast {name} to the input's dtype", shown)  # fmt: skip
    if r.device != x.device:
        fail(OP, ValueError, name, f"is on {r.device} but input is on {x.device}",
             f"move {name} to the input's device", shown)  # fmt: skip
    if r.dim() != 4 or any(rs not in (1, xs) for rs, xs in zip(r.shape, x.shape)):
        fail(OP, ValueError, name, f"shape {list(r.shape)} does not broadcast to input's "
             f"{list(x.shape)}", "give it 4 dims, each 1 or input's size (S11D for SBND)",
             shown)  # fmt: skip
    if r.shape[-1] != x.shape[-1]:
        fail(OP, ValueError, name, f"last dim {r.shape[-1]} is not input's D = {x.shape[-1]}",
             "give one angle per channel (cat(freqs, freqs) for 'half')", shown)  # fmt: skip


def rotate(x: torch.Tensor, rotary_mode: str) -> torch.Tensor:
    """The partner term: ``cat(-x2, x1)`` (half) or ``(-x[2i+1], x[2i])`` pairs (interleave)."""
    if rotary_mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1)  # [..., D/2, 2]
    return pairs.flatten(-2)


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """``r1 * input + r2 * rotate(input)`` (see the module doc for shapes and modes).

    Differentiable through autograd (in input, r1 and r2).

    Example::

        >>> x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
        >>> npu_rotary_mul(x, torch.zeros_like(x), torch.ones_like(x)).flatten().tolist()
        [-3.0, -4.0, 1.0, 2.0]
    """
    validate_rotary_mul(input, r1, r2, rotary_mode, kernel="reference")
    return (input * r1) + (rotate(input, rotary_mode) * r2)
