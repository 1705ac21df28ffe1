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
    return _Linear.apply(x, weight, bias, registry.resolve(OP_LINEAR, kernel, x.device).kernel)


def batch_invariant_sum(
    x: torch.Tensor, dim: int = -1, keepdim: bool = False, *, kernel: str = "auto"
) -> torch.Tensor:
    """``x`` summed over ``dim`` (one dimension), differentiable; ``kernel`` as
    :func:`batch_invariant_linear`'s."""
    validate_batch_invariant_sum(x, dim)
    chosen = registry.resolve(OP_SUM, kernel, x.device).kernel
    return _Sum.apply(x, dim % x.dim(), keepdim, chosen)


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
    rows = x.reshape(-1, x.shape[-1])
    out = _by_blocks(rows, lambda block: block @ weight.t())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def fixed_block_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """The reference: ``dim`` moved last, the other dims flattened into rows, one ``[ROWS, D]``
    sum per block of rows."""
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    out = _by_blocks(rows, lambda block: block.sum(-1, keepdim=True)).view(moved.shape[:-1])
    return out.unsqueeze(dim) if keepdim else out


def _by_blocks(rows: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` on ``rows [R, D]`` cut into zero-padded ``[ROWS, D]`` blocks -> ``[R, *]``."""
    count = rows.shape[0]
    padded = torch.nn.functional.pad(rows, (0, 0, 0, -count % ROWS)).contiguous()
    blocks = [fn(block.contiguous()) for block in padded.split(ROWS)]
    if not blocks:  # no rows: the shape of fn's answer on one block
        return fn(padded.new_zeros(ROWS, rows.shape[1]))[:0]
    return torch.cat(blocks)[:count]


class _Linear(torch.autograd.Function):
    """The forward through the chosen kernel; PyTorch's gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, kernel):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        if kernel == registry.REFERENCE:
            return fixed_block_linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        out = _library(OP_LINEAR, kernel)(rows, weight.t())
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])  # [T, N]
        grad_x = (rows @ weight).view(x.shape)
        grad_w = rows.t() @ x.reshape(-1, x.shape[-1])
        grad_b = rows.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, keepdim, kernel):
        ctx.shape, ctx.dim, ctx.keepdim = x.shape, dim, keepdim
        if kernel == registry.REFERENCE:
            return fixed_block_sum(x, dim, keepdim)
        return _library(OP_SUM, kernel)(x, dim, keepdim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad if ctx.keepdim else grad.unsqueeze(ctx.dim)
        return grad.expand(ctx.shape), None, None, None


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
