"""``torch_npu.npu_swiglu`` in plain PyTorch: same signature, semantics and refusals.

``npu_swiglu(self, dim=-1) -> Tensor``::

    x    [..., 2F, ...]   float16 | bfloat16 | float32 (float64: reference only), rank 1..8;
                          the size along ``dim`` must be even
    out  [..., F, ...]    silu(a) * b, where a, b = x.chunk(2, dim) (first half gated)

This is Megatron's ``swiglu`` (``torch.chunk(x, 2, dim=-1)``, ``F.silu(x1) * x2``) when
``gated_linear_unit=True`` and ``activation_func=F.silu``. Computed in float32 for 16-bit inputs,
cast back at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_npu.ops._checks import check_tensor, fail, is_int

OP = "npu_swiglu"
MAX_RANK = 8


def validate_swiglu(x, dim=-1, *, kernel: str = "reference") -> int:
    """Check one call; returns ``dim`` as a non-negative index.

    Raises:
        TypeError, ValueError: naming the argument (``self`` or ``dim``).
    """
    shown = (("self", x),)
    check_tensor(OP, "self", x, kernel, shown)
    if not 1 <= x.dim() <= MAX_RANK:
        fail(OP, ValueError, "self", f"rank {x.dim()} is outside 1..{MAX_RANK}",
             "pass a tensor with 1 to 8 dimensions", shown)  # fmt: skip
    if not is_int(dim):
        fail(OP, TypeError, "dim", f"expected an int, got {type(dim).__name__} ({dim!r})",
             "pass the dimension to split, e.g. -1", shown)  # fmt: skip
    if not -x.dim() <= dim < x.dim():
        fail(OP, ValueError, "dim", f"{dim} is out of range for a rank-{x.dim()} tensor",
             f"pass a dimension in {-x.dim()}..{x.dim() - 1}", shown)  # fmt: skip
    dim = dim % x.dim()
    if x.shape[dim] % 2:
        fail(OP, ValueError, "self", f"size {x.shape[dim]} along dim {dim} is odd: it cannot be "
             "split into the gate half and the linear half", "use an even size (2 * F)",
             shown)  # fmt: skip
    return dim


def npu_swiglu(self, dim=-1):
    """``silu(a) * b`` with ``a, b = self.chunk(2, dim)`` (see the module doc for shapes).

    Example::

        >>> npu_swiglu(torch.tensor([0.0, 1.0, 3.0, 2.0])).tolist()  # silu([0, 1]) * [3, 2]
        [0.0, 1.4621171951293945]
    """
    dim = validate_swiglu(self, dim, kernel="reference")
    compute = torch.float64 if self.dtype == torch.float64 else torch.float32
    a, b = self.to(compute).chunk(2, dim=dim)  # each [..., F, ...]
    return (F.silu(a) * b).to(self.dtype)
