"""``torch_npu.npu_grouped_matmul`` in plain PyTorch: same signature, list return and refusals
(floating point only: quantisation arguments None, ``act_type=0``)::

    group_type None / -1  y_i = x_i @ w_i (+ b_i) for each pair of the lists
    group_type 0          split M: x = [X [M, K]], weight = E x [K, N] or [[E, K, N]]
    group_type 2          split K: x = [A [m, K]], weight = [B [K, n]] -> [E, m, n]
    group_type 1          split N: refused (as by the operator)

``group_list``: E cumulative ends (``group_list_type=0``) or counts (1); ``split_item`` 0/1 one
output per group, 2/3 one tensor. 16-bit inputs are multiplied in float32 (specs/fused_ops.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_npu.ops._checks import check_tensor, describe, fail, is_int

OP = "npu_grouped_matmul"
QUANT_ARGUMENTS = ("scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale")
QUANT_ARGUMENTS += ("activation_input", "activation_quant_scale", "activation_quant_offset")
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
    x,
    weight,
    *,
    bias=None,
    group_list=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
    kernel="reference",
    **quant,
) -> GroupedPlan:
    """Check one call (``quant`` = the quantisation keywords); returns the plan."""
    _check_lists(x, weight, kernel)
    for name, value in quant.items():
        if value is not None:
            problem = "quantised grouped matmul is not implemented by the reference "
            problem += "(and not used by MoE training)"
            _fail(ValueError, name, problem, f"pass {name}=None", x, weight)
    _check_scalars(x, weight, split_item, group_type, group_list_type, act_type, output_dtype)
    weights = _weights_2d(x, weight)
    if group_type in (None, -1):
        sizes = _ungrouped(x, weights, group_list, split_item)
    else:
        sizes = _grouped(x, weights, group_list, group_type, group_list_type)
    _check_bias(x, weights, bias, group_type)
    group_type = group_type if group_type != -1 else None
    return GroupedPlan(group_type, sizes, tuple(weights), split_item in (2, 3))


def _check_lists(x, weight, kernel):
    for name, items in (("x", x), ("weight", weight)):
        if not isinstance(items, (list, tuple)) or not items:
            problem = f"expected a non-empty list of tensors, got {type(items).__name__}"
            _fail(TypeError, name, problem, f"wrap the tensor in a list: {name}=[t]")
        for i, t in enumerate(items):
            check_tensor(OP, f"{name}[{i}]", t, kernel)
    dtype, dev = x[0].dtype, x[0].device
    for name, items in (("x", x), ("weight", weight)):
        for i, t in enumerate(items):
            if t.dtype != dtype:
                problem = f"dtype {t.dtype} differs from x[0]'s {dtype}"
                fix = "give every x and weight tensor one dtype"
                _fail(TypeError, f"{name}[{i}]", problem, fix, x, weight)
            if t.device != dev:
                problem = f"is on {t.device}, x[0] on {dev}"
                fix = "move every tensor to one device"
                _fail(ValueError, f"{name}[{i}]", problem, fix, x, weight)
    for i, t in enumerate(x):
        if t.dim() != 2:
            problem = f"must be 2-D [M, K], got {describe(t)}"
            _fail(ValueError, f"x[{i}]", problem, "flatten the tokens to [M, K]", x, weight)


def _check_scalars(x, weight, split_item, group_type, group_list_type, act_type, output_dtype):
    checks = (
        ("split_item", split_item, (0, 1, 2, 3)),
        ("group_list_type", group_list_type, (0, 1)),
        ("act_type", act_type, (0,)),
    )
    for name, value, allowed in checks:
        if not is_int(value):
            problem = f"expected an int, got {type(value).__name__}"
            _fail(TypeError, name, problem, f"pass one of {allowed}", x, weight)
        if value not in allowed:
            fix = f"pass one of {allowed} (act_type: apply the activation after the call)"
            _fail(ValueError, name, f"{value} is not supported", fix, x, weight)
    if group_type is not None and not is_int(group_type):
        problem = f"expected an int or None, got {type(group_type).__name__}"
        fix = "pass None, 0 (split M) or 2 (split K)"
        _fail(TypeError, "group_type", problem, fix, x, weight)
    if group_type not in GROUP_TYPES:
        why = "split N is not supported" if group_type == 1 else "unknown group type"
        fix = "pass None (no grouping), 0 (split M) or 2 (split K)"
        _fail(ValueError, "group_type", f"{group_type}: {why}", fix, x, weight)
    if output_dtype is not None and output_dtype != x[0].dtype:
        problem = f"{output_dtype} differs from x's {x[0].dtype} "
        problem += "(only quantised calls change the dtype)"
        _fail(ValueError, "output_dtype", problem, "pass output_dtype=None", x, weight)


def _weights_2d(x, weight) -> list[torch.Tensor]:
    if len(weight) == 1 and weight[0].dim() == 3:
        return list(weight[0].unbind(0))  # [E, K, N] -> E x [K, N]
    for i, w in enumerate(weight):
        if w.dim() != 2:
            problem = f"must be 2-D [K, N] (or one 3-D [E, K, N]), got {describe(w)}"
            fix = "pass per-group [K, N] matrices"
            _fail(ValueError, f"weight[{i}]", problem, fix, x, weight)
    return list(weight)


def _ungrouped(x, weights, group_list, split_item):
    if group_list is not None:
        problem = "is given but group_type is None (no grouping)"
        fix = "pass group_type=0 to split x's rows by group_list"
        _fail(ValueError, "group_list", problem, fix, x, weights)
    if len(x) != len(weights):
        problem = f"{len(weights)} weights for {len(x)} x tensors"
        _fail(ValueError, "weight", problem, "pass one weight per x tensor", x, weights)
    for i, (a, w) in enumerate(zip(x, weights)):
        if a.shape[1] != w.shape[0]:
            problem = f"K={w.shape[0]} does not match x[{i}]'s K={a.shape[1]}"
            _fail(ValueError, f"weight[{i}]", problem, "pass [K, N] weights", x, weights)
    if split_item in (2, 3) and len({w.shape[1] for w in weights}) > 1:
        problem = f"{split_item} concatenates the outputs, whose N differ"
        fix = "use split_item=0 for a list of outputs"
        _fail(ValueError, "split_item", problem, fix, x, weights)
    return None


def _grouped(x, weights, group_list, group_type, group_list_type) -> tuple[int, ...]:
    if len(x) != 1:
        problem = f"group_type={group_type} takes one x tensor, got {len(x)}"
        fix = "concatenate the groups' rows into one tensor"
        _fail(ValueError, "x", problem, fix, x, weights)
    if group_type == 2 and len(weights) != 1:
        problem = f"group_type=2 takes one [K, n] weight, got {len(weights)}"
        _fail(ValueError, "weight", problem, "concatenate the groups along K", x, weights)
    if group_type == 0 and len({tuple(w.shape) for w in weights}) > 1:
        problem = "the groups' weights differ in shape"
        fix = "give every group a [K, N] weight of one shape"
        _fail(ValueError, "weight", problem, fix, x, weights)
    if x[0].shape[1] != weights[0].shape[0]:
        problem = f"K={weights[0].shape[0]} does not match x's K={x[0].shape[1]}"
        fix = "pass [K, N] weights (transpose [N, K] ones)"
        _fail(ValueError, "weight", problem, fix, x, weights)
    total = x[0].shape[0] if group_type == 0 else x[0].shape[1]
    groups = len(weights) if group_type == 0 else None
    return _group_sizes(x, weights, group_list, group_list_type, total, groups)


def _group_sizes(x, weights, group_list, group_list_type, total, groups) -> tuple[int, ...]:
    if group_list is None:
        problem = "is required when group_type is 0 or 2"
        fix = "pass the rows per group (group_list_type=1) or their cumulative ends (0)"
        _fail(ValueError, "group_list", problem, fix, x, weights)
    if isinstance(group_list, torch.Tensor):
        if group_list.dim() != 1 or group_list.dtype.is_floating_point or group_list.is_complex():
            problem = f"must be a 1-D integer tensor, got {describe(group_list)}"
            fix = "pass an int64 tensor of E entries"
            _fail(TypeError, "group_list", problem, fix, x, weights)
        values = [int(v) for v in group_list.tolist()]
    elif isinstance(group_list, (list, tuple)) and all(is_int(v) for v in group_list):
        values = [int(v) for v in group_list]
    else:
        problem = f"expected a list of ints or an integer tensor, got {type(group_list).__name__}"
        _fail(TypeError, "group_list", problem, "pass E group sizes", x, weights)
    if groups is not None and len(values) != groups:
        problem = f"has {len(values)} entries for {groups} weights"
        fix = "give one entry per group (expert)"
        _fail(ValueError, "group_list", problem, fix, x, weights)
    if group_list_type == 1:
        sizes = values
    else:
        if any(b < a for a, b in zip([0, *values], values)):
            problem = f"cumulative ends {values} decrease"
            fix = "pass non-decreasing ends, or counts with group_list_type=1"
            _fail(ValueError, "group_list", problem, fix, x, weights)
        sizes = [b - a for a, b in zip([0, *values], values)]
    if any(s < 0 for s in sizes) or sum(sizes) != total:
        kind = "counts" if group_list_type == 1 else "cumulative ends"
        problem = f"{kind} {values} do not cover the {total} rows/columns being split"
        fix = "make the sizes non-negative and add up to that dimension"
        _fail(ValueError, "group_list", problem, fix, x, weights)
    return tuple(sizes)


def _check_bias(x, weights, bias, group_type):
    if bias is None:
        return
    if group_type == 2:
        problem = "is not supported with group_type=2 (split K)"
        _fail(ValueError, "bias", problem, "add the bias outside the call", x, weights)
    if not isinstance(bias, (list, tuple)) or len(bias) != len(weights):
        problem = f"expected a list of {len(weights)} tensors (one per weight)"
        fix = "pass bias=[b_0, ..., b_E-1] of shape [N]"
        _fail(TypeError, "bias", problem, fix, x, weights)
    allowed = {x[0].dtype, torch.float32} if x[0].dtype == torch.bfloat16 else {x[0].dtype}
    for i, (b, w) in enumerate(zip(bias, weights)):
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (w.shape[1],):
            problem = f"must be a tensor of shape [{w.shape[1]}], got {describe(b)}"
            fix = "pass one [N] bias per weight"
            _fail(ValueError, f"bias[{i}]", problem, fix, x, weights)
        if b.dtype not in allowed:
            problem = f"dtype {b.dtype} is not {sorted(map(str, allowed))}"
            fix = "cast the bias to x's dtype (float32 for bfloat16 x)"
            _fail(TypeError, f"bias[{i}]", problem, fix, x, weights)


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
):
    """Grouped matrix products; returns a list of tensors, differentiable (``mm`` per group)."""
    quant = dict(scale=scale, offset=offset, antiquant_scale=antiquant_scale)
    quant.update(antiquant_offset=antiquant_offset, per_token_scale=per_token_scale)
    quant.update(activation_input=activation_input, activation_quant_scale=activation_quant_scale)
    quant.update(activation_quant_offset=activation_quant_offset)
    grouping = dict(group_list=group_list, split_item=split_item, group_type=group_type)
    rest = dict(group_list_type=group_list_type, act_type=act_type, output_dtype=output_dtype)
    plan = validate_grouped_matmul(x, weight, bias=bias, **grouping, **rest, **quant)
    biases = [None] * len(plan.weights) if bias is None else bias
    if plan.group_type is None:
        outs = [_mm(a, w, b) for a, w, b in zip(x, plan.weights, biases)]
        return [torch.cat(outs, dim=0)] if plan.single_output else outs
    if plan.group_type == 0:
        pieces = x[0].split(list(plan.sizes), dim=0)  # E x [m_e, K]
        outs = [_mm(p, w, b) for p, w, b in zip(pieces, plan.weights, biases)]
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
