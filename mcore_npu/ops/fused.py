"""The fused operators beyond attention on the kernel the registry picks (``kernel = auto |
torch_npu | reference``), each call validated first:

- :func:`rms_norm` -> ``torch_npu.npu_rms_norm`` or :func:`mcore_npu.ops.npu_rms_norm.npu_rms_norm`
- :func:`swiglu` -> ``torch_npu.npu_swiglu`` or :func:`mcore_npu.ops.npu_swiglu.npu_swiglu`
- :func:`grouped_linear` -> ``npu_grouped_matmul`` three times per projection (forward, dX, dW)
  through :class:`GroupedLinear` (per-expert biases optional)
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
    """One ``npu_grouped_matmul(x, weight, **op_kwargs)`` call on the chosen kernel; keywords the
    installed torch_npu does not take are a reason its kernel cannot run it."""
    first = x[0] if isinstance(x, (list, tuple)) and x else x
    unknown = set(op_kwargs) - set(inspect.signature(gmm.npu_grouped_matmul).parameters)
    if unknown:
        raise TypeError(
            f"grouped_matmul: unknown operator keyword(s) {sorted(unknown)}; "
            "see mcore_npu.ops.npu_grouped_matmul for the operator's keywords"
        )
    keywords = tuple(op_kwargs)
    chosen = registry.resolve("grouped_matmul", kernel, _device(first), keywords=keywords).kernel
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
    """``y[rows of e] = x[rows of e] @ W_e.T (+ b_e)``, one grouped matmul per pass: weights in
    Megatron's ``[N, K]`` layout, dX with ``weight=[W_e]``, dW one ``group_type=2`` call
    (``[E, K, N]``; one ``mm`` per expert without ``group_type``), db_e the column sums of dY."""

    @staticmethod
    def forward(ctx, x, counts, kernel, num_biases, *params):
        weights, biases = params[: len(params) - num_biases], params[len(params) - num_biases :]
        ctx.kernel, ctx.counts, ctx.num_biases = kernel, counts, num_biases
        ctx.save_for_backward(x, *weights)
        ctx.bias_dtypes = [b.dtype for b in biases]
        bias = list(biases) if biases else None
        weights_t = [w.t() for w in weights]
        return _call(kernel, [x], weights_t, counts, split_item=2, group_type=0, bias=bias)[0]

    @staticmethod
    def backward(ctx, grad_y):
        x, *weights = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        kernel, counts = ctx.kernel, ctx.counts
        grad_x = _call(kernel, [grad_y], list(weights), counts, split_item=2, group_type=0)[0]
        if _supports(kernel, "group_type"):
            stacked = _call(kernel, [x.t()], [grad_y], counts, split_item=3, group_type=2)[0]
            grads_w = [g.t() for g in stacked.unbind(0)]  # stacked: [E, K, N]
        else:
            ends = torch.cumsum(counts.cpu(), 0).tolist()
            starts = [0, *ends[:-1]]
            grads_w = [grad_y[s:e].t() @ x[s:e] for s, e in zip(starts, ends)]
        grads_b = _bias_grads(grad_y, counts, ctx.bias_dtypes) if ctx.num_biases else []
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
    """Expert projection: x [T, K] (rows sorted by expert), weights E x [N, K], rows per expert
    ``tokens_per_expert`` [E] (zeros allowed), ``biases`` None or E x [N] -> y [T, N]."""
    chosen = registry.resolve("grouped_matmul", kernel, _device(x)).kernel
    counts = torch.as_tensor(tokens_per_expert, dtype=torch.int64)
    counts = counts.to(x.device) if chosen == "torch_npu" else counts.cpu()
    biases = list(biases or [])
    if biases and len(biases) != len(weights):
        raise ValueError(
            f"biases: {len(biases)} biases for {len(weights)} weights; pass one "
            "[N] bias per expert or biases=None"
        )
    return GroupedLinear.apply(x, counts, chosen, len(biases), *weights, *biases)


def _supports(kernel: str, keyword: str) -> bool:
    if kernel != "torch_npu":
        return True
    return keyword in grouped_matmul_keywords(registry.ascend("grouped_matmul"))


def _call(kernel, x, weight, counts, *, split_item, group_type, bias=None):
    """One operator call with the group list as counts (cumulative where counts are unknown)."""
    kwargs = dict(group_list=counts, split_item=split_item, group_type=group_type)
    kwargs["group_list_type"] = 1
    if bias is not None:
        kwargs["bias"] = bias
    if not _supports(kernel, "group_list_type"):
        kwargs.update(group_list=torch.cumsum(counts, 0))
        del kwargs["group_list_type"]
    if not _supports(kernel, "group_type"):
        del kwargs["group_type"]
    return grouped_matmul(x, weight, kernel=kernel, **kwargs)
