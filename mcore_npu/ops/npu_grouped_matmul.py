"""``torch_npu.npu_grouped_matmul`` in plain PyTorch: same signature, list return and refusals.

The floating-point operator (quantisation arguments must be None, ``act_type=0``)::

    group_type None / -1  no grouping: y_i = x_i @ w_i (+ b_i) for each pair of the lists
    group_type 0          split M (tokens): x = [X [M, K]], weight = E x [K, N] or [[E, K, N]];
                          rows of group e (from group_list) -> Y[rows] = X[rows] @ W_e (+ b_e)
    group_type 2          split K: x = [A [m, K]], weight = [B [K, n]]; group e covers K-slice
                          k_e -> Y_e = A[:, k_e] @ B[k_e, :]  (the weight gradient of MoE experts)
    group_type 1          split N: refused (the operator does not support it either)

    group_list       E group sizes: group_list_type=0 cumulative end offsets (non-decreasing,
                     last = the split dimension's size), 1 counts (sum = that size); a list of
                     ints or a 1-D integer tensor (read on the host). Groups of size 0 are allowed.
    split_item       0/1: one output tensor per group (or per list pair); 2/3: one output tensor
                     (group_type 0: [M, N] concatenated; group_type 2: [E, m, n] stacked)
    output           a list of tensors in x's dtype

The MoE use (MindSpeed's scheme, see :class:`GroupedLinear`): forward ``x=[tokens [T, H]]``,
``weight=[W_e [H, F]]``, ``split_item=2, group_type=0``; backward dX with the transposed weights
and the same group list; dW with ``group_type=2`` over ``x=[tokens.t()]`` and ``weight=[dY]``.
16-bit inputs are multiplied in float32 and cast back (the NPU accumulates in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_npu.ops._checks import check_tensor, describe, fail, is_int

OP = "npu_grouped_matmul"
QUANT_ARGUMENTS = (
    "scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale",
    "activation_input", "activation_quant_scale", "activation_quant_offset",
)  # fmt: skip
GROUP_TYPES = (None, -1, 0, 2)


@dataclass(frozen=True)
class GroupedPlan:
    """A validated call: ``sizes`` = group sizes (None without grouping), weights as 2-D list."""

    group_type: int | None
    sizes: tuple[int, ...] | None
    weights: tuple[torch.Tensor, ...]
    single_output: bool


def _fail(exc, argument, problem, fix, x=None, weight=None):
    shown = []
    for name, items in (("x", x), ("weight", weight)):
        if isinstance(items, (list, tuple)):
            shown += [(f"{name}[{i}]", t) for i, t in enumerate(items[:4])]
    fail(OP, exc, argument, problem, fix, shown)


def validate_grouped_matmul(
    x, weight, *, bias=None, group_list=None, split_item=0, group_type=None, group_list_type=0,
    act_type=0, output_dtype=None, kernel="reference", **quant,
) -> GroupedPlan:  # fmt: skip
    """Check one call (``quant`` = the quantisation keywords); returns the plan.

    Raises:
        TypeError, ValueError: naming the argument, with what to do instead.
    """
    _check_lists(x, weight, kernel)
    for name, value in quant.items():
        if value is not None:
            _fail(ValueError, name, "quantised grouped matmul is not implemented by the reference "
                  "(and not used by MoE training)", f"pass {name}=None", x, weight)  # fmt: skip
    _check_scalars(x, weight, split_item, group_type, group_list_type, act_type, output_dtype)
    weights = _weights_2d(x, weight)
    if group_type in (None, -1):
        sizes = _ungrouped(x, weights, group_list, split_item)
    else:
        sizes = _grouped(x, weights, group_list, group_type, group_list_type)
    _check_bias(x, weights, bias, group_type)
    return GroupedPlan(group_type if group_type != -1 else None, sizes, tuple(weights),
                       split_item in (2, 3))  # fmt: skip


def _check_lists(x, weight, kernel):
    for name, items in (("x", x), ("weight", weight)):
        if not isinstance(items, (list, tuple)) or not items:
            _fail(TypeError, name, f"expected a non-empty list of tensors, got "
                  f"{type(items).__name__}", f"wrap the tensor in a list: {name}=[t]")  # fmt: skip
        for i, t in enumerate(items):
            check_tensor(OP, f"{name}[{i}]", t, kernel)
    dtype, dev = x[0].dtype, x[0].device
    for name, items in (("x", x), ("weight", weight)):
        for i, t in enumerate(items):
            if t.dtype != dtype:
                _fail(TypeError, f"{name}[{i}]", f"dtype {t.dtype} differs from x[0]'s {dtype}",
                      "give every x and weight tensor one dtype", x, weight)  # fmt: skip
            if t.device != dev:
                _fail(ValueError, f"{name}[{i}]", f"is on {t.device}, x[0] on {dev}",
                      "move every tensor to one device", x, weight)  # fmt: skip
    for i, t in enumerate(x):
        if t.dim() != 2:
            _fail(ValueError, f"x[{i}]", f"must be 2-D [M, K], got {describe(t)}",
                  "flatten the tokens to [M, K]", x, weight)  # fmt: skip


def _check_scalars(x, weight, split_item, group_type, group_list_type, act_type, output_dtype):
    checks = (("split_item", split_item, (0, 1, 2, 3)), ("group_list_type", group_list_type,
              (0, 1)), ("act_type", act_type, (0,)))  # fmt: skip
    for name, value, allowed in checks:
        if not is_int(value):
            _fail(TypeError, name, f"expected an int, got {type(value).__name__}",
                  f"pass one of {allowed}", x, weight)  # fmt: skip
        if value not in allowed:
            _fail(ValueError, name, f"{value} is not supported", f"pass one of {allowed} "
                  "(act_type: apply the activation after the call)", x, weight)  # fmt: skip
    if group_type is not None and not is_int(group_type):
        _fail(TypeError, "group_type", f"expected an int or None, got {type(group_type).__name__}",
              "pass None, 0 (split M) or 2 (split K)", x, weight)  # fmt: skip
    if group_type not in GROUP_TYPES:
        why = "split N is not supported" if group_type == 1 else "unknown group type"
        _fail(ValueError, "group_type", f"{group_type}: {why}",
              "pass None (no grouping), 0 (split M) or 2 (split K)", x, weight)  # fmt: skip
    if output_dtype is not None and output_dtype != x[0].dtype:
        _fail(ValueError, "output_dtype", f"{output_dtype} differs from x's {x[0].dtype} (only "
              "quantised calls change the dtype)", "pass output_dtype=None", x, weight)  # fmt: skip


def _weights_2d(x, weight) -> list[torch.Tensor]:
    if len(weight) == 1 and weight[0].dim() == 3:
        return list(weight[0].unbind(0))  # [E, K, N] -> E x [K, N]
    for i, w in enumerate(weight):
        if w.dim() != 2:
            _fail(ValueError, f"weight[{i}]", f"must be 2-D [K, N] (or one 3-D [E, K, N]), got "
                  f"{describe(w)}", "pass per-group [K, N] matrices", x, weight)  # fmt: skip
    return list(weight)


def _ungrouped(x, weights, group_list, split_item):
    if group_list is not None:
        _fail(ValueError, "group_list", "is given but group_type is None (no grouping)",
              "pass group_type=0 to split x's rows by group_list", x, weights)  # fmt: skip
    if len(x) != len(weights):
        _fail(ValueError, "weight", f"{len(weights)} weights for {len(x)} x tensors",
              "pass one weight per x tensor", x, weights)  # fmt: skip
    for i, (a, w) in enumerate(zip(x, weights)):
        if a.shape[1] != w.shape[0]:
            _fail(ValueError, f"weight[{i}]", f"K={w.shape[0]} does not match x[{i}]'s "
                  f"K={a.shape[1]}", "pass [K, N] weights", x, weights)  # fmt: skip
    if split_item in (2, 3) and len({w.shape[1] for w in weights}) > 1:
        _fail(ValueError, "split_item", f"{split_item} concatenates the outputs, whose N differ",
              "use split_item=0 for a list of outputs", x, weights)  # fmt: skip
    return None


def _grouped(x, weights, group_list, group_type, group_list_type) -> tuple[int, ...]:
    if len(x) != 1:
        _fail(ValueError, "x", f"group_type={group_type} takes one x tensor, got {len(x)}",
              "concatenate the groups' rows into one tensor", x, weights)  # fmt: skip
    if group_type == 2 and len(weights) != 1:
        _fail(ValueError, "weight", f"group_type=2 takes one [K, n] weight, got {len(weights)}",
              "concatenate the groups along K", x, weights)  # fmt: skip
    if group_type == 0 and len({tuple(w.shape) for w in weights}) > 1:
        _fail(ValueError, "weight", "the groups' weights differ in shape",
              "give every group a [K, N] weight of one shape", x, weights)  # fmt: skip
    if x[0].shape[1] != weights[0].shape[0]:
        _fail(ValueError, "weight", f"K={weights[0].shape[0]} does not match x's K="
              f"{x[0].shape[1]}", "pass [K, N] weights (transpose [N, K] ones)", x, weights)  # fmt: skip
    total = x[0].shape[0] if group_type == 0 else x[0].shape[1]
    groups = len(weights) if group_type == 0 else None
    return _group_sizes(x, weights, group_list, group_list_type, total, groups)


def _group_sizes(x, weights, group_list, group_list_type, total, groups) -> tuple[int, ...]:
    if group_list is None:
        _fail(ValueError, "group_list", "is required when group_type is 0 or 2",
              "pass the rows per group (group_list_type=1) or their cumulative ends (0)",
              x, weights)  # fmt: skip
    if isinstance(group_list, torch.Tensor):
        if group_list.dim() != 1 or group_list.dtype.is_floating_point or group_list.is_complex():
            _fail(TypeError, "group_list", f"must be a 1-D integer tensor, got "
                  f"{describe(group_list)}", "pass an int64 tensor of E entries", x, weights)  # fmt: skip
        values = [int(v) for v in group_list.tolist()]
    elif isinstance(group_list, (list, tuple)) and all(is_int(v) for v in group_list):
        values = [int(v) for v in group_list]
    else:
        _fail(TypeError, "group_list", f"expected a list of ints or an integer tensor, got "
              f"{type(group_list).__name__}", "pass E group sizes", x, weights)  # fmt: skip
    if groups is not None and len(values) != groups:
        _fail(ValueError, "group_list", f"has {len(values)} entries for {groups} weights",
              "give one entry per group (expert)", x, weights)  # fmt: skip
    if group_list_type == 1:
        sizes = values
    else:
        if any(b < a for a, b in zip([0, *values], values)):
            _fail(ValueError, "group_list", f"cumulative ends {values} decrease",
                  "pass non-decreasing ends, or counts with group_list_type=1", x, weights)  # fmt: skip
        sizes = [b - a for a, b in zip([0, *values], values)]
    if any(s < 0 for s in sizes) or sum(sizes) != total:
        kind = "counts" if group_list_type == 1 else "cumulative ends"
        _fail(ValueError, "group_list", f"{kind} {values} do not cover the {total} rows/columns "
              "being split", "make the sizes non-negative and add up to that dimension",
              x, weights)  # fmt: skip
    return tuple(sizes)


def _check_bias(x, weights, bias, group_type):
    if bias is None:
        return
    if group_type == 2:
        _fail(ValueError, "bias", "is not supported with group_type=2 (split K)",
              "add the bias outside the call", x, weights)  # fmt: skip
    if not isinstance(bias, (list, tuple)) or len(bias) != len(weights):
        _fail(TypeError, "bias", f"expected a list of {len(weights)} tensors (one per weight)",
              "pass bias=[b_0, ..., b_E-1] of shape [N]", x, weights)  # fmt: skip
    allowed = {x[0].dtype, torch.float32} if x[0].dtype == torch.bfloat16 else {x[0].dtype}
    for i, (b, w) in enumerate(zip(bias, weights)):
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (w.shape[1],):
            _fail(ValueError, f"bias[{i}]", f"must be a tensor of shape [{w.shape[1]}], got "
                  f"{describe(b)}", "pass one [N] bias per weight", x, weights)  # fmt: skip
        if b.dtype not in allowed:
            _fail(TypeError, f"bias[{i}]", f"dtype {b.dtype} is not {sorted(map(str, allowed))}",
                  "cast the bias to x's dtype (float32 for bfloat16 x)", x, weights)  # fmt: skip


def npu_grouped_matmul(
    x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
    antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
    activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
    group_list_type=0, act_type=0, output_dtype=None,
):  # fmt: skip
    """Grouped matrix products; returns a list of tensors (see the module doc for the contract).

    Differentiable through autograd (a loop of ``mm`` per group).

    Example (two experts, the second with zero tokens; counts)::

        >>> x = torch.ones(3, 2); w = [torch.eye(2), 2 * torch.eye(2)]
        >>> npu_grouped_matmul([x], w, group_list=[3, 0], group_list_type=1,
        ...                    split_item=2, group_type=0)[0].shape
        torch.Size([3, 2])
    """
    quant = dict(scale=scale, offset=offset, antiquant_scale=antiquant_scale,
                 antiquant_offset=antiquant_offset, per_token_scale=per_token_scale,
                 activation_input=activation_input, activation_quant_scale=activation_quant_scale,
                 activation_quant_offset=activation_quant_offset)  # fmt: skip
    plan = validate_grouped_matmul(
        x, weight, bias=bias, group_list=group_list, split_item=split_item, group_type=group_type,
        group_list_type=group_list_type, act_type=act_type, output_dtype=output_dtype, **quant,
    )  # fmt: skip
    if plan.group_type is None:
        outs = [_mm(a, w, None if bias is None else bias[i]) for i, (a, w) in
                enumerate(zip(x, plan.weights))]  # fmt: skip
        return [torch.cat(outs, dim=0)] if plan.single_output else outs
    if plan.group_type == 0:
        pieces = x[0].split(list(plan.sizes), dim=0)  # E x [m_e, K]
        outs = [_mm(p, w, None if bias is None else bias[e]) for e, (p, w) in
                enumerate(zip(pieces, plan.weights))]  # fmt: skip
        if plan.single_output:
            return [torch.cat(outs, dim=0) if outs else x[0].new_zeros(0, 0)]
        return outs
    a_parts = x[0].split(list(plan.sizes), dim=1)  # E x [m, k_e]
    b_parts = plan.weights[0].split(list(plan.sizes), dim=0)  # E x [k_e, n]
    outs = [_mm(a, b, None) for a, b in zip(a_parts, b_parts)]  # E x [m, n]
    return [torch.stack(outs, dim=0)] if plan.single_output else outs


def _mm(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``a @ w (+ b)`` computed in float32 for 16-bit inputs (float64 stays float64)."""
    compute = torch.float64 if a.dtype == torch.float64 else torch.float32
    out = a.to(compute) @ w.to(compute)
    if b is not None:
        out = out + b.to(compute)
    return out.to(a.dtype)
