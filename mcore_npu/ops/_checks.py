"""Shared argument checks for the fused operators (rms_norm, swiglu, grouped_matmul).

Every failure raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value) with a message that
starts with ``<operator>: <argument>:``, shows the tensors received, and ends with ``fix: ...``.
"""

from __future__ import annotations

import math
import numbers

import torch

REAL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""What the NPU kernels take. The references also take float64 (oracles, gradcheck)."""


def describe(t) -> str:
    """``[2, 3] float32 on cpu`` for a tensor, the type name otherwise."""
    if isinstance(t, torch.Tensor):
        return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"
    return f"{type(t).__name__} (not a tensor)"


def fail(op: str, exc: type[Exception], argument: str, problem: str, fix: str, shown=()) -> None:
    """Raise ``exc`` naming ``op`` and ``argument``; ``shown`` = ``[(name, tensor), ...]``."""
    lines = [f"{op}: {argument}: {problem}"]
    lines += [f"  {name + ':':<11}{describe(t)}" for name, t in shown]
    lines.append(f"  fix: {fix}")
    raise exc("\n".join(lines))


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_tensor(op: str, name: str, t, kernel: str, shown=()) -> None:
    """``t`` is a floating tensor of a dtype the chosen kernel takes."""
    if not isinstance(t, torch.Tensor):
        problem = f"expected a torch.Tensor, got {type(t).__name__}"
        fail(op, TypeError, name, problem, "pass a tensor", shown)
    allowed = REAL_DTYPES + ((torch.float64,) if kernel == "reference" else ())
    if t.dtype not in allowed:
        only = " (float64: reference kernel only)" if t.dtype == torch.float64 else ""
        names = ", ".join(str(d).removeprefix("torch.") for d in REAL_DTYPES)
        problem = f"dtype {t.dtype} is not supported{only}"
        fail(op, TypeError, name, problem, f"cast it to one of {names}", shown)


def check_finite_nonnegative(op: str, name: str, value) -> None:
    if not is_real(value):
        problem = f"expected a real number, got {type(value).__name__}"
        fail(op, TypeError, name, problem, "pass a float such as 1e-6")
    if not math.isfinite(value) or value < 0:
        problem = f"must be finite and >= 0, got {value!r}"
        fail(op, ValueError, name, problem, "pass a small positive float such as 1e-6")
