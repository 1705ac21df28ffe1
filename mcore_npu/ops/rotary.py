"""``torch_npu.npu_rotary_mul`` in plain PyTorch: same signature, semantics and refusals::

    input   [A, B, C, D]   4-D (SBND, BSND or BNSD), float16 | bfloat16 | float32 (float64:
                           reference only); D even, < 896; B, C < 1000 (interleave: B * C)
    r1, r2  broadcastable to input (S11D for SBND), input's dtype; r1 = cos, r2 = sin
    out     r1 * x + r2 * rotate(x), input's dtype

``"half"`` rotates ``cat(-x2, x1)`` (Megatron's rotate-half), ``"interleave"`` the pairs
``(-x[2i+1], x[2i])`` (``rotary_interleaved``), in the input's dtype (specs/fused_ops.md)."""

from __future__ import annotations

import torch

from mcore_npu.ops._checks import check_tensor, fail

OP = "npu_rotary_mul"
ROTARY_MODES = ("half", "interleave")
MAX_HEAD_DIM = 896  # D must be below this
MAX_BATCH = 1000  # each of dims 1 and 2 (B, N of SBND) below this; interleave: their product


def validate_rotary_mul(x, r1, r2, rotary_mode="half", *, kernel: str = "reference") -> None:
    """Check one call as the real operator does (errors name ``input``, ``r1``, ``r2`` or
    ``rotary_mode``)."""
    shown = (("input", x), ("r1", r1), ("r2", r2))
    for name, t in shown:
        check_tensor(OP, name, t, kernel, shown)
    if not isinstance(rotary_mode, str) or rotary_mode not in ROTARY_MODES:
        problem = f"unknown mode {rotary_mode!r}"
        fix = "pass 'half' (Megatron's rotate-half) or 'interleave' (rotary_interleaved)"
        fail(OP, ValueError, "rotary_mode", problem, fix, shown)
    if x.dim() != 4:
        fix = "pass a 4-D tensor (SBND, BSND or BNSD; packed thd as [T, 1, N, D])"
        fail(OP, ValueError, "input", f"rank {x.dim()} is not 4", fix, shown)
    _check_sizes(x, rotary_mode, shown)
    for name, r in (("r1", r1), ("r2", r2)):
        _check_angles(name, r, x, shown)


def _check_sizes(x, rotary_mode, shown) -> None:
    d = x.shape[-1]
    if d % 2 or d >= MAX_HEAD_DIM or d == 0:
        problem = f"last dim D = {d} must be even, > 0 and < {MAX_HEAD_DIM}"
        fix = "rotate an even number of channels below 896 (slice the rotary part first)"
        fail(OP, ValueError, "input", problem, fix, shown)
    b, n = x.shape[1], x.shape[2]
    if b >= MAX_BATCH or n >= MAX_BATCH:
        problem = f"dims 1 and 2 are {b} and {n}; each must be < {MAX_BATCH}"
        fix = "split the call along dim 1 or 2 into pieces below 1000"
        fail(OP, ValueError, "input", problem, fix, shown)
    if rotary_mode == "interleave" and b * n >= MAX_BATCH:
        problem = f"interleave mode needs dim1 * dim2 < {MAX_BATCH}, got {b} * {n} = {b * n}"
        fix = "split the call along dim 1 or 2 (or use 'half')"
        fail(OP, ValueError, "input", problem, fix, shown)


def _check_angles(name, r, x, shown) -> None:
    if r.dtype != x.dtype:
        problem = f"dtype {r.dtype} differs from input's {x.dtype}"
        fail(OP, TypeError, name, problem, f"cast {name} to the input's dtype", shown)
    if r.device != x.device:
        problem = f"is on {r.device} but input is on {x.device}"
        fail(OP, ValueError, name, problem, f"move {name} to the input's device", shown)
    if r.dim() != 4 or any(rs not in (1, xs) for rs, xs in zip(r.shape, x.shape)):
        problem = f"shape {list(r.shape)} does not broadcast to input's {list(x.shape)}"
        fix = "give it 4 dims, each 1 or input's size (S11D for SBND)"
        fail(OP, ValueError, name, problem, fix, shown)
    if r.shape[-1] != x.shape[-1]:
        problem = f"last dim {r.shape[-1]} is not input's D = {x.shape[-1]}"
        fix = "give one angle per channel (cat(freqs, freqs) for 'half')"
        fail(OP, ValueError, name, problem, fix, shown)


def rotate(x: torch.Tensor, rotary_mode: str) -> torch.Tensor:
    """The partner term: ``cat(-x2, x1)`` (half) or ``(-x[2i+1], x[2i])`` pairs (interleave)."""
    if rotary_mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1)  # [..., D/2, 2]
    return pairs.flatten(-2)


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """``r1 * input + r2 * rotate(input)``, differentiable in input, r1 and r2."""
    validate_rotary_mul(input, r1, r2, rotary_mode, kernel="reference")
    return (input * r1) + (rotate(input, rotary_mode) * r2)
