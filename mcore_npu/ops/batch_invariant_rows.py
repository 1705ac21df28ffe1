"""Batch-invariant row operators: a row's result depends only on that row.

- :func:`batch_invariant_linear`: ``x [*, K] @ weight [N, K]^T (+ bias [N])`` -> ``[*, N]``;
- :func:`batch_invariant_sum`: ``x`` summed over one dimension.

On an NPU the kernels are the AscendC batch-invariant operator library vllm-ascend installs
(``batch_invariant_ops``, built with ``VLLM_BATCH_INVARIANT=1``): ``npu_matmul_batch_invariant``
and ``npu_reduce_sum_batch_invariant``, the operators vllm-ascend registers for ``aten::matmul``
and ``aten::sum``. Here they are called, nothing is registered over torch. Elsewhere the
references cut the rows into blocks of :data:`ROWS` (the last zero-padded) and run one
fixed-shape operation per block: every row is computed by the same call shape wherever it sits.
Gradients are PyTorch's ordinary ones (the mode's promise is about the forward's bits).
"""

from __future__ import annotations

import torch

from mcore_npu.ops import registry

__all__ = [
    "LIBRARY",
    "ROWS",
    "batch_invariant_linear",
    "batch_invariant_sum",
    "fixed_block_linear",
    "fixed_block_sum",
    "missing_kernel",
]

ROWS = 64
"""Row block of the references: every matmul is ``[ROWS, K] x [K, N]``, every sum over
``[ROWS, D]``, whatever the number of rows."""
LIBRARY = "batch_invariant_ops"
"""The AscendC library's module and its ``torch.ops`` namespace."""
OP_LINEAR, OP_SUM = OPS = ("batch_invariant_linear", "batch_invariant_sum")
ATTRIBUTES = {OP_LINEAR: "npu_matmul_batch_invariant", OP_SUM: "npu_reduce_sum_batch_invariant"}
"""Each operator's name in the library's ``torch.ops`` namespace."""


def batch_invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    kernel: str = "auto",
) -> torch.Tensor:
    """``x [*, K] @ weight [N, K]^T (+ bias [N])`` -> ``[*, N]`` in ``x``'s dtype, differentiable.

    kernel: ``"auto"`` (the AscendC library on NPU tensors, else the reference),
    ``"batch_invariant_ops"`` or ``"reference"``.
    """
    validate_batch_invariant_linear(x, weight, bias)
    chosen = registry.resolve(OP_LINEAR, kernel, x.device).kernel
    rows = _Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias, chosen)
    return rows.view(*x.shape[:-1], weight.shape[0])  # a view made outside the Function


def batch_invariant_sum(
    x: torch.Tensor, dim: int = -1, keepdim: bool = False, *, kernel: str = "auto"
) -> torch.Tensor:
    """``x`` summed over ``dim`` (one dimension), differentiable; ``kernel`` as
    :func:`batch_invariant_linear`'s."""
    validate_batch_invariant_sum(x, dim)
    chosen = registry.resolve(OP_SUM, kernel, x.device).kernel
    moved = x.movedim(dim, -1)
    total = _Sum.apply(moved.reshape(-1, moved.shape[-1]), chosen).view(moved.shape[:-1])
    return total.unsqueeze(dim) if keepdim else total


def validate_batch_invariant_linear(x, weight, bias=None, **_) -> None:
    """Shapes of one linear call; ValueError naming the argument."""
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"batch_invariant_linear: weight must be [N, K] with K = x's last dim; got x "
            f"{tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(
            f"batch_invariant_linear: bias must be [N] = [{weight.shape[0]}], got "
            f"{tuple(bias.shape)}"
        )


def validate_batch_invariant_sum(x, dim=-1, **_) -> None:
    """One integer ``dim`` within ``x``'s dimensions; TypeError / ValueError naming it."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"batch_invariant_sum: dim must be one int, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"batch_invariant_sum: dim {dim} is outside x's {x.dim()} dimensions")


def fixed_block_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """The reference: ``x``'s rows in blocks of :data:`ROWS`, one ``[ROWS, K] x [K, N]`` matmul
    each, in ``x``'s dtype."""
    return _reference_linear(x.reshape(-1, x.shape[-1]), weight, bias).view(
        *x.shape[:-1], weight.shape[0]
    )


def fixed_block_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """The reference: ``dim`` moved last, the other dims flattened into rows, one ``[ROWS, D]``
    sum per block of rows."""
    moved = x.movedim(dim, -1)
    total = _reference_sum(moved.reshape(-1, moved.shape[-1])).view(moved.shape[:-1])
    return total.unsqueeze(dim) if keepdim else total


def _reference_linear(rows: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``rows [R, K]`` -> ``[R, N]``, a tensor of its own (no view)."""
    out = _by_blocks(rows, lambda block: block @ weight.t())
    return out if bias is None else out + bias


def _reference_sum(rows: torch.Tensor) -> torch.Tensor:
    """``rows [R, D]`` -> ``[R]``, a tensor of its own (no view)."""
    return _by_blocks(rows, lambda block: block.sum(-1))


def _by_blocks(rows: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` on ``rows [R, D]`` cut into zero-padded ``[ROWS, D]`` blocks, each block's first
    rows written into one new ``[R, *]`` tensor."""
    count = rows.shape[0]
    padded = torch.nn.functional.pad(rows, (0, 0, 0, -count % ROWS))
    blocks = padded.split(ROWS) or (padded.new_zeros(ROWS, rows.shape[1]),)  # no rows: a shape
    out = None
    for start, block in zip(range(0, max(count, 1), ROWS), blocks, strict=False):
        answer = fn(block.contiguous())
        if out is None:
            out = answer.new_empty((count, *answer.shape[1:]))
        out[start : start + ROWS] = answer[: count - start]
    return out


class _Linear(torch.autograd.Function):
    """``rows [T, K] @ weight [N, K]^T (+ bias [N])`` -> ``[T, N]`` through the chosen kernel;
    PyTorch's gradients, for the inputs that need them."""

    @staticmethod
    def forward(ctx, rows, weight, bias, kernel):
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        if kernel == registry.REFERENCE:
            return _reference_linear(rows, weight, bias)
        out = _library(OP_LINEAR, kernel)(rows, weight.t())
        return out if bias is None else out + bias

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        grad_x = grad @ weight if need_x else None
        grad_w = grad.t() @ rows if need_w else None
        grad_b = grad.sum(0) if ctx.has_bias and need_b else None
        return grad_x, grad_w, grad_b, None


class _Sum(torch.autograd.Function):
    """``rows [R, D]`` -> ``[R]`` through the chosen kernel; the gradient broadcast back."""

    @staticmethod
    def forward(ctx, rows, kernel):
        ctx.width = rows.shape[1]
        if kernel == registry.REFERENCE:
            return _reference_sum(rows)
        return _library(OP_SUM, kernel)(rows, 1, False)

    @staticmethod
    def backward(ctx, grad):
        return grad.unsqueeze(1).expand(-1, ctx.width), None


def _library(op: str, kernel: str):
    """The AscendC library's operator for ``op`` (``torch.ops.batch_invariant_ops.<name>``)."""
    registry.ascend(op, kernel)  # imports the library: it registers its torch.ops namespace
    return getattr(getattr(torch.ops, LIBRARY), ATTRIBUTES[op])


def missing_kernel(on_npu: bool) -> str | None:
    """One line naming what to install when ``on_npu`` and the AscendC library cannot run; None
    when it can, or off an NPU (the references run there)."""
    if not on_npu:
        return None
    for op in OPS:
        reason = registry.why_not(registry.operator(op).kernels[0])
        if reason is not None:
            return (
                f"batch-invariant mode on an NPU needs {LIBRARY} for its matmuls and sums "
                f"({reason}); install vllm-ascend built with VLLM_BATCH_INVARIANT=1 (it builds "
                "the batch-invariant operator library), or turn the mode off"
            )
    return None
