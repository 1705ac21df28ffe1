"""``torch_npu.npu_swiglu`` in plain PyTorch (Megatron's ``swiglu``): same signature, semantics
and refusals. x ``[..., 2F, ...]`` (rank 1..8, float16 | bfloat16 | float32; float64: reference
only) -> ``silu(a) * b`` ``[..., F, ...]`` with ``a, b = x.chunk(2, dim)``, computed in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_npu.ops._checks import check_tensor, fail, is_int

OP = "npu_swiglu"
MAX_RANK = 8


def validate_swiglu(x, dim=-1, *, kernel: str = "reference") -> int:
    """Check one call (errors name ``self`` or ``dim``); returns ``dim`` as a non-negative index."""
    shown = (("self", x),)
    check_tensor(OP, "self", x, kernel, shown)
    if not 1 <= x.dim() <= MAX_RANK:
        problem = f"rank {x.dim()} is outside 1..{MAX_RANK}"
        fail(OP, ValueError, "self", problem, "pass a tensor with 1 to 8 dimensions", shown)
    if not is_int(dim):
        problem = f"expected an int, got {type(dim).__name__} ({dim!r})"
        fail(OP, TypeError, "dim", problem, "pass the dimension to split, e.g. -1", shown)
    if not -x.dim() <= dim < x.dim():
        problem = f"{dim} is out of range for a rank-{x.dim()} tensor"
        fix = f"pass a dimension in {-x.dim()}..{x.dim() - 1}"
        fail(OP, ValueError, "dim", problem, fix, shown)
    dim = dim % x.dim()
    if x.shape[dim] % 2:
        problem = f"size {x.shape[dim]} along dim {dim} is odd: "
        problem += "it cannot be split into the gate half and the linear half"
        fail(OP, ValueError, "self", problem, "use an even size (2 * F)", shown)
    return dim


def npu_swiglu(self, dim=-1):
    """``silu(a) * b`` with ``a, b = self.chunk(2, dim)``."""
    dim = validate_swiglu(self, dim, kernel="reference")
    compute = torch.float64 if self.dtype == torch.float64 else torch.float32
    a, b = self.to(compute).chunk(2, dim=dim)  # each [..., F, ...]
    return (F.silu(a) * b).to(self.dtype)
