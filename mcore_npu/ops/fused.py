"""Dispatch of the fused operators beyond attention: ``kernel = auto | torch_npu | reference``.

- :func:`rms_norm` -> ``torch_npu.npu_rms_norm`` or :func:`mcore_npu.ops.npu_rms_norm.npu_rms_norm`
- :func:`swiglu` -> ``torch_npu.npu_swiglu`` or :func:`mcore_npu.ops.npu_swiglu.npu_swiglu`
- :func:`grouped_linear` -> ``npu_grouped_matmul`` three times per projection (forward, dX, dW),
  MindSpeed's backward scheme, through :class:`GroupedLinear` (per-expert biases optional)

Every call is validated first (the same checks for both kernels), then reaches the kernel the
registry picks (``mcore_npu.ops.registry``) with exactly the documented arguments.
"""

from __future__ import annotations

import inspect

import torch

from mcore_npu.ops import npu_grouped_matmul as gmm
from mcore_npu.ops import npu_rms_norm as rms
from mcore_npu.ops import npu_swiglu as glu
from mcore_npu.ops import registry
from mcore_npu.ops.probes import grouped_matmul_keywords

GROUPED_MATMUL_NEWER_KEYWORDS = ("group_type", "group_list_type")
"""Keywords older ``npu_grouped_matmul`` releases (torch 2.1/2.2 builds) do not take."""


def _device(t):
    return getattr(t, "device", torch.device("cpu"))


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6, *, kernel="auto"):
    """``npu_rms_norm(x, gamma, epsilon=epsilon)[0]``: x [*, H] -> y [*, H] (rstd dropped)."""
    chosen = registry.resolve("rms_norm", kernel, _device(x)).kernel
    rms.validate_rms_norm(x, gamma, epsilon, kernel=chosen)
    if chosen == "torch_npu":
        return registry.ascend("rms_norm")(x, gamma, epsilon=epsilon)[0]
    return rms.npu_rms_norm(x, gamma, epsilon=epsilon)[0]


def swiglu(x: torch.Tensor, dim: int = -1, *, kernel="auto") -> torch.Tensor:
    """``npu_swiglu(x, dim=dim)``: [..., 2F] -> [..., F], silu(first half) * second half."""
    chosen = registry.resolve("swiglu", kernel, _device(x)).kernel
    glu.validate_swiglu(x, dim, kernel=chosen)
    if chosen == "torch_npu":
        return registry.ascend("swiglu")(x, dim=dim)
    return glu.npu_swiglu(x, dim=dim)


def grouped_matmul(x, weight, *, kernel="auto", **op_kwargs) -> list[torch.Tensor]:
    """One ``npu_grouped_matmul(x, weight, **op_kwargs)`` call on the chosen kernel.

    Keywords that the installed torch_npu does not take (older releases stop at ``group_list``,
    ``split_item``, ``output_dtype``) are a reason the kernel cannot run the call (the registry's
    policy: raised for ``kernel="torch_npu"``, the reference with a warning for ``"auto"``).
    """
    first = x[0] if isinstance(x, (list, tuple)) and x else x
    unknown = set(op_kwargs) - set(inspect.signature(gmm.npu_grouped_matmul).parameters)
    if unknown:
        raise TypeError(f"grouped_matmul: unknown operator keyword(s) {sorted(unknown)}; "
                        "see mcore_npu.ops.npu_grouped_matmul for the operator's keywords")  # fmt: skip
    chosen = registry.resolve("grouped_matmul", kernel, _device(first),
                              keywords=tuple(op_kwargs)).kernel  # fmt: skip
    if chosen != "torch_npu":
        gmm.validate_grouped_matmul(x, weight, kernel=chosen, **op_kwargs)
        return gmm.npu_grouped_matmul(x, weight, **op_kwargs)
    op = registry.ascend("grouped_matmul")
    checked = dict(op_kwargs)
    if "group_type" not in grouped_matmul_keywords(op) and checked.get("group_list") is not None:
        checked["group_type"] = 0  # older releases split x's rows (M) by group_list
    gmm.validate_grouped_matmul(x, weight, kernel=chosen, **checked)
    return op(x, weight, **op_kwargs)


class GroupedLinear(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ W_e.T (+ b_e)`` with one grouped matmul per pass.

    Weights keep Megatron's linear layout ``[N, K]`` (out, in); the operator sees ``W_e.T``.
    Forward: ``(x=[X], weight=[W_e.T], bias=[b_e] or None, group_list, split_item=2,
    group_type=0)``. Backward: dX with ``weight=[W_e]`` and the same group list; dW with
    ``x=[X.T], weight=[dY], split_item=3, group_type=2`` -> ``[E, K, N]``, dW_e = its e-th slice
    transposed; db_e = the column sums of expert e's rows of dY (one ``index_add_``, no host
    sync). A torch_npu without ``group_type`` (older releases) gets dW from one ``mm`` per expert.
    """

    @staticmethod
    def forward(ctx, x, counts, kernel, num_biases, *params):
        weights, biases = params[: len(params) - num_biases], params[len(params) - num_biases :]
        ctx.kernel, ctx.counts, ctx.num_biases = kernel, counts, num_biases
        ctx.save_for_backward(x, *weights)
        ctx.bias_dtypes = [b.dtype for b in biases]
        return _call(kernel, [x], [w.t() for w in weights], counts, split_item=2, group_type=0,
                     bias=list(biases) if biases else None)[0]  # fmt: skip

    @staticmethod
    def backward(ctx, grad_y):
        x, *weights = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = _call(ctx.kernel, [grad_y], list(weights), ctx.counts, split_item=2,
                       group_type=0)[0]  # fmt: skip
        if _supports(ctx.kernel, "group_type"):
            stacked = _call(ctx.kernel, [x.t()], [grad_y], ctx.counts, split_item=3,
                            group_type=2)[0]  # [E, K, N]  # fmt: skip
            grads_w = [g.t() for g in stacked.unbind(0)]
        else:
            ends = torch.cumsum(ctx.counts.cpu(), 0).tolist()
            starts = [0, *ends[:-1]]
            grads_w = [grad_y[s:e].t() @ x[s:e] for s, e in zip(starts, ends)]
        grads_b = _bias_grads(grad_y, ctx.counts, ctx.bias_dtypes) if ctx.num_biases else []
        return (grad_x, None, None, None, *grads_w, *grads_b)


def _bias_grads(grad_y: torch.Tensor, counts: torch.Tensor, dtypes) -> list[torch.Tensor]:
    """E x [N]: the column sums of each expert's rows of ``grad_y`` [T, N], accumulated in
    float32 (float64 stays float64), cast to each bias's dtype."""
    experts = torch.arange(len(dtypes), device=grad_y.device)
    rows = torch.repeat_interleave(experts, counts.to(grad_y.device), output_size=grad_y.shape[0])
    compute = torch.float64 if grad_y.dtype == torch.float64 else torch.float32
    sums = grad_y.new_zeros(len(dtypes), grad_y.shape[1], dtype=compute)
    sums.index_add_(0, rows, grad_y.to(compute))
    return [s.to(dtype) for s, dtype in zip(sums.unbind(0), dtypes)]


def grouped_linear(x: torch.Tensor, weights, tokens_per_expert, *, biases=None, kernel="auto"):
    """Expert projection: x [T, K] (rows sorted by expert), weights E x [N, K] -> y [T, N].

    ``tokens_per_expert`` [E] (int tensor or list) gives the rows per expert; zeros allowed.
    ``biases``: None or E x [N], added to each expert's rows inside the operator (``bias=``).
    """
    chosen = registry.resolve("grouped_matmul", kernel, _device(x)).kernel
    counts = torch.as_tensor(tokens_per_expert, dtype=torch.int64)
    counts = counts.to(x.device) if chosen == "torch_npu" else counts.cpu()
    biases = list(biases or [])
    if biases and len(biases) != len(weights):
        raise ValueError(f"biases: {len(biases)} biases for {len(weights)} weights; pass one "
                         "[N] bias per expert or biases=None")  # fmt: skip
    return GroupedLinear.apply(x, counts, chosen, len(biases), *weights, *biases)


def _supports(kernel: str, keyword: str) -> bool:
    if kernel != "torch_npu":
        return True
    return keyword in grouped_matmul_keywords(registry.ascend("grouped_matmul"))


def _call(kernel, x, weight, counts, *, split_item, group_type, bias=None):
    """One operator call with the group list as counts (cumulative where counts are unknown)."""
    kwargs = dict(group_list=counts, split_item=split_item, group_type=group_type,
                  group_list_type=1)  # fmt: skip
    if bias is not None:
        kwargs["bias"] = bias
    if not _supports(kernel, "group_list_type"):
        kwargs.update(group_list=torch.cumsum(counts, 0))
        del kwargs["group_list_type"]
    if not _supports(kernel, "group_type"):
        del kwargs["group_type"]
    return grouped_matmul(x, weight, kernel=kernel, **kwargs)
