"""The fused-operator table's cases (``specs/fused_ops_cases.yaml``) and their float64 oracle.

``make_call`` draws a case's seeded inputs and the operator's arguments; the oracle is written
from the operator contracts (explicit sums, no code shared with ``mcore_npu.ops``).
``check_reference_fused_case`` compares the reference with it, ``check_kernel_fused_case``
torch_npu (through the ``ops`` dispatch) with the float32 reference on the same rounded inputs.
"""

from __future__ import annotations

import itertools

import torch

from mcore_npu.tools import permute_cases
from mcore_npu.tools.cases import FUSED_TABLE, FusedCase, load_table, table_kind
from mcore_npu.tools.comparison import CaseResult, compare, normal

OPERATORS = FusedCase.operators
QUANTITIES = FusedCase.quantities


def is_fused_table(path) -> bool:
    """Whether ``path`` is a fused-operator table (``kind: fused_ops``)."""
    return table_kind(path) == FusedCase.kind


def load_fused_cases(path=None) -> list[FusedCase]:
    return load_table(path or FUSED_TABLE)


def make_call(case: FusedCase, dtype: torch.dtype, device="cpu"):
    """``(leaves, kwargs)``: rms_norm ``[x, gamma]``; swiglu ``[x]``; grouped matmul ``[x,
    *weights]`` (x split per group by the call for ``group_type=None``); rotary_mul ``[x, r1,
    r2]`` (cos and sin of seeded angles, shaped ``angle_shape``)."""
    s = case.seed
    if case.operator in permute_cases.OPERATORS:
        return permute_cases.make_call(case, dtype, device)
    if case.operator == "npu_rotary_mul":
        return _rotary_call(case, dtype, device)
    if case.operator == "npu_rms_norm":
        shape = case.param("shape")
        x = normal(shape, s) * 2
        gamma = normal(shape[len(shape) - case.param("gamma_rank") :], s + 1)
        leaves = [x, gamma]
        kwargs = {"epsilon": case.param("epsilon")}
    elif case.operator == "npu_swiglu":
        leaves, kwargs = [normal(case.param("shape"), s) * 2], {"dim": case.param("dim")}
    else:
        counts, k, n = case.param("counts"), case.param("k"), case.param("n")
        if case.param("group_type") == 2:
            leaves = [normal((n, sum(counts)), s), normal((sum(counts), k), s + 1)]
        else:
            weights = [normal((k, n), s + 1 + e) / k**0.5 for e in range(len(counts))]
            leaves = [normal((sum(counts), k), s), *weights]
            if case.param("bias"):  # one [N] bias per group: leaves [x, *weights, *biases]
                leaves += [normal((n,), s + 101 + e) for e in range(len(counts))]
        cumulative = case.param("group_list_type") != 1
        group_list = list(itertools.accumulate(counts)) if cumulative else counts
        kwargs = {k: case.param(k) for k in ("split_item", "group_type", "group_list_type")}
        if case.param("group_type") is not None:
            kwargs["group_list"] = torch.tensor(group_list, dtype=torch.int64, device=device)
    leaves = [t.to(dtype).to(device).requires_grad_(True) for t in leaves]
    return leaves, kwargs


def _rotary_call(case: FusedCase, dtype, device):
    angles = normal(case.param("angle_shape"), case.seed + 1) * 3
    leaves = [normal(case.param("shape"), case.seed), torch.cos(angles), torch.sin(angles)]
    leaves = [t.to(dtype).to(device).requires_grad_(True) for t in leaves]
    return leaves, {"rotary_mode": case.param("rotary_mode")}


def _rotary_oracle(case: FusedCase, leaves) -> torch.Tensor:
    """Channel by channel: channel c pairs with p(c) and takes sign s(c) (the contract)."""
    x, r1, r2 = leaves
    d = x.shape[-1]
    if case.param("rotary_mode") == "half":
        partner = [(c + d // 2) % d for c in range(d)]
        sign = [-1.0 if c < d // 2 else 1.0 for c in range(d)]
    else:
        partner = [c + 1 if c % 2 == 0 else c - 1 for c in range(d)]
        sign = [-1.0 if c % 2 == 0 else 1.0 for c in range(d)]
    columns = [x[..., c] * r1[..., c] + sign[c] * x[..., partner[c]] * r2[..., c] for c in range(d)]
    return torch.stack(columns, dim=-1)


def call_operator(case: FusedCase, op, leaves, kwargs) -> torch.Tensor:
    """Run ``op`` (a torch_npu-shaped callable) on the case; the output as one tensor."""
    if case.operator in permute_cases.OPERATORS:
        return permute_cases.call_operator(case, op, leaves, kwargs)
    if case.operator == "npu_rms_norm":
        return op(leaves[0], leaves[1], **kwargs)[0]
    if case.operator == "npu_swiglu":
        return op(leaves[0], **kwargs)
    if case.operator == "npu_rotary_mul":
        from mcore_npu.ops.fused_rotary import rotary_mul_takes_mode

        if kwargs["rotary_mode"] == "half" and not rotary_mul_takes_mode(op):
            return op(*leaves)  # a 6.0.x torch_npu: no rotary_mode (half only)
        return op(*leaves, **kwargs)
    x, weights = leaves[0], leaves[1:]
    if case.param("bias"):  # leaves [x, *weights, *biases]
        half = len(weights) // 2
        weights, kwargs = weights[:half], {**kwargs, "bias": weights[half:]}
    if case.param("group_type") is None:
        x_list = list(x.split(case.param("counts"), dim=0))
        return torch.cat(op(x_list, weights, **kwargs), dim=0)
    if case.param("weight_3d"):
        weights = [torch.stack(weights)]
    out = op([x], weights, **kwargs)
    return torch.cat([o.reshape(-1) for o in out]) if len(out) > 1 else out[0]


def oracle(case: FusedCase, leaves) -> torch.Tensor:
    """The float64 answer from the contract (explicit sums; differentiable)."""
    if case.operator in permute_cases.OPERATORS:
        return permute_cases.oracle(case, leaves)
    if case.operator == "npu_rms_norm":
        x, gamma = leaves
        dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
        mean_square = (x * x).sum(dim=dims, keepdim=True) / gamma.numel()
        return x * gamma / torch.sqrt(mean_square + case.param("epsilon"))
    if case.operator == "npu_swiglu":
        (x,) = leaves
        dim, half = case.param("dim"), leaves[0].shape[case.param("dim")] // 2
        a, b = x.narrow(dim, 0, half), x.narrow(dim, half, half)
        return a * b / (1 + torch.exp(-a))
    if case.operator == "npu_rotary_mul":
        return _rotary_oracle(case, leaves)
    counts, x, weights = case.param("counts"), leaves[0], leaves[1:]
    biases = weights[len(counts) :] if case.param("bias") else [0] * len(counts)
    blocks, start = [], 0
    for e, c in enumerate(counts):
        if case.param("group_type") == 2:  # Y_e = A[:, k_e] @ B[k_e, :]
            a, b = x[:, start : start + c], weights[0][start : start + c]
            blocks.append((a.unsqueeze(2) * b.unsqueeze(0)).sum(1))
        else:  # Y[rows_e] = X[rows_e] @ W_e
            rows = x[start : start + c]
            blocks.append((rows.unsqueeze(2) * weights[e].unsqueeze(0)).sum(1) + biases[e])
        start += c
    if case.param("group_type") == 2:
        return torch.stack(blocks)
    if case.param("split_item") in (0, 1) and case.param("group_type") is not None:
        return torch.cat([b.reshape(-1) for b in blocks])
    return torch.cat(blocks, dim=0)


def _compare_all(case, got, got_leaves, want, want_leaves, upstream):
    got_grads = torch.autograd.grad(got, got_leaves, upstream.to(got.dtype), allow_unused=True)
    want_grads = torch.autograd.grad(want, want_leaves, upstream.to(want.dtype), allow_unused=True)
    comparisons = [compare("forward", got, want, None, case.forward)]
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        g = torch.zeros_like(got_leaves[i]) if g is None else g
        w = torch.zeros_like(want_leaves[i]) if w is None else w
        name = "grad0" if i == 0 else "grad1"
        if i >= 2:  # further weights: fold into grad1 (the worst of them counts)
            prev = next(c for c in comparisons if c.name == "grad1")
            new = compare(name, g, w, None, case.grad)
            if new.max_error > prev.max_error:
                comparisons[comparisons.index(prev)] = new
            continue
        comparisons.append(compare(name, g, w, None, case.grad))
    return CaseResult(case.id, tuple(comparisons))


def check_reference_fused_case(case: FusedCase, device="cpu"):
    """The reference in the case's dtype against the float64 oracle."""
    from mcore_npu.ops import reference

    leaves, kwargs = make_call(case, case.dtype, device)
    got = call_operator(case, getattr(reference, case.operator), leaves, kwargs)
    exact, _ = make_call(case, case.dtype, "cpu")
    exact = [t.detach().double().requires_grad_(True) for t in exact]  # the same rounded inputs
    want = oracle(case, exact)
    upstream = normal(want.shape, case.seed + 99)
    return _compare_all(case, got, leaves, want, exact, upstream)


def check_kernel_fused_case(case: FusedCase, device):
    """torch_npu on ``device`` against the float32 reference on the CPU (same rounded inputs)."""
    from mcore_npu.ops import reference, registry

    leaves, kwargs = make_call(case, case.dtype, device)
    got = call_operator(case, registry.by_attribute(case.operator), leaves, kwargs)
    rounded, cpu_kwargs = make_call(case, case.dtype, "cpu")
    wide = [t.detach().float().requires_grad_(True) for t in rounded]
    want = call_operator(case, getattr(reference, case.operator), wide, cpu_kwargs)
    upstream = normal(want.shape, case.seed + 99)
    return _compare_all(case, got, leaves, want, wide, upstream)
