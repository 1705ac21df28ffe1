"""The Gated DeltaNet table's cases (``specs/gated_delta_cases.yaml``) and their float64 oracles.

``make_call`` draws a case's seeded inputs. The oracles run the definitions token by token in
float64 (the recurrence ``S_t = e^{g_t} (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``,
``o_t = S_t^T q_t``; the convolution as explicit sums over taps), sharing no code with
``mcore_npu.ops``. ``check_reference_gdn_case`` compares the reference with them,
``check_kernel_gdn_case`` the kernel ``auto`` picks on the device with the float32 reference.
"""

from __future__ import annotations

import itertools
from contextlib import nullcontext

import torch

from mcore_npu.tools.cases import GDN_TABLE, GatedDeltaCase, load_table, table_kind
from mcore_npu.tools.comparison import compare_outputs, normal

OPERATORS = GatedDeltaCase.operators
QUANTITIES = GatedDeltaCase.quantities


def is_gated_delta_table(path) -> bool:
    """Whether ``path`` is a Gated DeltaNet table (``kind: gated_delta``)."""
    return table_kind(path) == GatedDeltaCase.kind


def load_gated_delta_cases(path=None) -> list[GatedDeltaCase]:
    return load_table(path or GDN_TABLE)


def _uniform(shape, seed) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _layout(case: GatedDeltaCase) -> tuple[int, int, list[int] | None]:
    """``(batch, tokens, cu_seqlens bounds or None)``."""
    segments = case.param("segments")
    if segments is None:
        return case.param("batch"), case.param("tokens"), None
    bounds = [0, *itertools.accumulate(segments)]
    return 1, bounds[-1], bounds


def make_call(case: GatedDeltaCase, dtype: torch.dtype, device="cpu"):
    """``(leaves, kwargs)``: the differentiable inputs in call order and the other arguments."""
    s = case.seed
    if case.operator == "chunk_gated_delta_rule":
        leaves, kwargs = _rule_inputs(case, s, device)
    elif case.operator == "causal_conv1d":
        b, t, bounds = _layout(case)
        c, w = case.param("channels"), case.param("width")
        leaves = [normal((b, t, c), s), normal((c, 1, w), s + 1) / w**0.5]
        if case.param("bias"):
            leaves.append(0.5 * normal((c,), s + 2))
        kwargs = {"cu_seqlens": _bounds_tensor(bounds, device)}
    elif case.operator == "l2norm":
        x = normal(case.param("shape"), s)
        if case.param("tiny"):
            x = x * 1e-4  # rows small enough for eps to matter
        leaves, kwargs = [x], {}
    else:
        shape = case.param("shape")
        weight = 1 + 0.3 * normal(shape[-1:], s + 2)
        leaves = [normal(shape, s), normal(shape, s + 1), weight]
        kwargs = {"eps": case.param("eps")}
    leaves = [t.to(dtype).to(device).requires_grad_(not case.param("no_grad")) for t in leaves]
    return leaves, kwargs


def _bounds_tensor(bounds, device):
    return None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device=device)


def _rule_inputs(case: GatedDeltaCase, s: int, device):
    b, t, bounds = _layout(case)
    (h, hv), (dk, dv) = case.param("heads"), case.param("dims")
    q, k = normal((b, t, h, dk), s), normal((b, t, h, dk), s + 1)
    if not case.param("l2norm"):  # the caller's q and k arrive unit-norm
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    decay = case.param("decay")
    if case.param("strong"):
        g = torch.full((b, t, hv), decay, dtype=torch.float64)
    else:
        g = decay * _uniform((b, t, hv), s + 3)
    beta = torch.sigmoid(normal((b, t, hv), s + 4))
    leaves = [q, k, normal((b, t, hv, dv), s + 2), g, beta]
    if case.param("initial"):
        rows = b if bounds is None else len(bounds) - 1
        leaves.append(0.5 * normal((rows, hv, dk, dv), s + 5))
    kwargs = {"cu_seqlens": _bounds_tensor(bounds, device), "output_final_state": True}
    kwargs["use_qk_l2norm_in_kernel"] = bool(case.param("l2norm"))
    return leaves, kwargs


def call_operator(case: GatedDeltaCase, leaves, kwargs, kernel: str = "reference"):
    """Run the operator through ``mcore_npu.ops.gated_delta``: ``(out, final state or None)``."""
    from mcore_npu.ops import gated_delta

    if case.operator == "chunk_gated_delta_rule":
        q, k, v, g, beta, *init = leaves
        return gated_delta.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=init[0] if init else None, kernel=kernel, **kwargs
        )
    if case.operator == "causal_conv1d":
        return gated_delta.causal_conv1d(*leaves, **kwargs), None
    if case.operator == "l2norm":
        return gated_delta.l2norm(*leaves), None
    return gated_delta.gated_rms_norm(*leaves, **kwargs), None


def oracle(case: GatedDeltaCase, leaves, kwargs):
    """The float64 answer from the definitions (differentiable): ``(out, state or None)``."""
    if case.operator == "chunk_gated_delta_rule":
        q, k, v, g, beta, *init = leaves
        state = init[0] if init else None
        bounds = kwargs["cu_seqlens"]
        bounds = None if bounds is None else bounds.tolist()
        l2norm = kwargs["use_qk_l2norm_in_kernel"]
        return recurrent_rule(q, k, v, g, beta, initial_state=state, bounds=bounds, l2norm=l2norm)
    if case.operator == "causal_conv1d":
        bounds = kwargs["cu_seqlens"]
        x, weight, *bias = leaves
        bounds = None if bounds is None else bounds.tolist()
        return conv_oracle(x, weight, bounds, bias[0] if bias else None), None
    if case.operator == "l2norm":
        (x,) = leaves
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6), None
    x, z, weight = leaves
    rms = torch.sqrt((x * x).mean(-1, keepdim=True) + kwargs["eps"])
    return weight * (x / rms) * z / (1 + torch.exp(-z)), None


def recurrent_rule(q, k, v, g, beta, *, initial_state=None, bounds=None, l2norm=False, scale=None):
    """The gated delta rule token by token in float64: q, k ``[B, T, H, K]``; v ``[B, T, HV,
    V]``; g, beta ``[B, T, HV]``; initial_state ``[B or N, HV, K, V]``; bounds: packed segment
    bounds (B == 1). Returns ``(o [B, T, HV, V], final [B or N, HV, K, V])``."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, t, heads, dk = q.shape
    value_heads = v.shape[2]
    head_of = [h // (value_heads // heads) for h in range(value_heads)]
    if bounds is None:
        segments = [(row, 0, t) for row in range(b)]
    else:
        segments = [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]
    outs, finals = {}, []
    for n, (row, start, end) in enumerate(segments):
        heads_final = []
        for h in range(value_heads):
            if initial_state is None:
                state = v.new_zeros(dk, v.shape[-1])
            else:
                state = initial_state[n, h].double()
            for i in range(start, end):
                kt, qt = k[row, i, head_of[h]], q[row, i, head_of[h]] * scale
                state = torch.exp(g[row, i, h]) * state
                state = state + beta[row, i, h] * torch.outer(kt, v[row, i, h] - kt @ state)
                outs[row, i, h] = qt @ state
            heads_final.append(state)
        finals.append(torch.stack(heads_final))
    out = torch.stack([outs[key] for key in sorted(outs)]).unflatten(0, (b, t, value_heads))
    return out, torch.stack(finals)


def conv_oracle(x, weight, bounds=None, bias=None):
    """``silu(bias[c] + sum_j w[c, j] x[t - (W - 1) + j, c])`` over taps inside the token's
    segment."""
    b, t, c = x.shape
    width = weight.shape[-1]
    starts = [0] * t
    for s, e in zip((bounds or [0, t])[:-1], (bounds or [0, t])[1:]):
        starts[s:e] = [s] * (e - s)
    rows = []
    for i in range(t):
        acc = x.new_zeros(b, c) if bias is None else bias.expand(b, c)
        for j in range(width):
            src = i - (width - 1) + j
            if src >= starts[i]:
                acc = acc + weight[:, 0, j] * x[:, src]
        rows.append(acc / (1 + torch.exp(-acc)))
    return torch.stack(rows, dim=1)


def _grad_mode(case):
    return torch.no_grad() if case.param("no_grad") else nullcontext()


def check_reference_gdn_case(case: GatedDeltaCase, device="cpu"):
    """The reference in the case's dtype against the float64 oracle (same rounded inputs)."""
    leaves, kwargs = make_call(case, case.dtype, device)
    with _grad_mode(case):
        got = call_operator(case, leaves, kwargs, "reference")
    exact, cpu_kwargs = make_call(case, case.dtype, "cpu")
    exact = [t.detach().double().requires_grad_(not case.param("no_grad")) for t in exact]
    with _grad_mode(case):
        want = oracle(case, exact, cpu_kwargs)
    return compare_outputs(case, got, leaves, want, exact)


def check_kernel_gdn_case(case: GatedDeltaCase, device):
    """The kernel ``auto`` picks on ``device`` against the float32 reference on the CPU."""
    leaves, kwargs = make_call(case, case.dtype, device)
    with _grad_mode(case):
        got = call_operator(case, leaves, kwargs, "auto")
    rounded, cpu_kwargs = make_call(case, case.dtype, "cpu")
    wide = [t.detach().float().requires_grad_(not case.param("no_grad")) for t in rounded]
    with _grad_mode(case):
        want = call_operator(case, wide, cpu_kwargs, "reference")
    return compare_outputs(case, got, leaves, want, wide)
