"""The Mamba2 table's cases (``specs/mamba_cases.yaml``) and their float64 oracles.

``make_call`` draws a case's seeded inputs. The oracles run the definitions in float64 sharing
no code with ``mcore_npu.ops``: the scan token by token (``state_t = exp(dt'_t A) state_{t-1} +
dt'_t x_t B_t^T``, ``y_t = state_t C_t + D x_t``, times ``silu(z_t)``), the gated norm group by
group. ``check_reference_mamba_case`` compares the reference with them,
``check_kernel_mamba_case`` the kernel ``auto`` picks on the device with the fp32 reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_npu.tools.cases import MAMBA_TABLE, MambaCase, load_table
from mcore_npu.tools.comparison import compare_outputs, normal

OPERATORS = MambaCase.operators
QUANTITIES = MambaCase.quantities
SCAN_LEAVES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
"""The scan's differentiable arguments in call order (a case leaves out the ones it omits)."""


def load_mamba_cases(path=None) -> list[MambaCase]:
    return load_table(path or MAMBA_TABLE)


def make_call(case: MambaCase, dtype: torch.dtype, device="cpu"):
    """``(leaves, kwargs)``: the differentiable inputs in call order (their names in
    ``kwargs["names"]``) and the other arguments."""
    if case.operator == "mamba_chunk_scan_combined":
        named, kwargs = _scan_inputs(case)
    else:
        named, kwargs = _norm_inputs(case)
    kwargs["names"] = tuple(named)
    leaves = [t.to(dtype).to(device).requires_grad_() for t in named.values()]
    return leaves, kwargs


def _scan_inputs(case: MambaCase):
    s = case.seed
    b, t = case.param("batch"), case.param("tokens")
    (h, p), (g, n) = case.param("heads"), case.param("groups")
    named = {"x": normal((b, t, h, p), s)}
    if case.param("softplus"):
        named["dt"] = normal((b, t, h), s + 1) - 1.0
    else:  # positive steps (the default dt_limit clamps negative ones to 0)
        named["dt"] = 0.1 + normal((b, t, h), s + 1).abs()
    named["A"] = -case.param("decay") * (0.2 + normal((h,), s + 2).abs())
    named["B"], named["C"] = normal((b, t, g, n), s + 3), normal((b, t, g, n), s + 4)
    d_shape = {"head": (h,), "headdim": (h, p)}.get(case.param("D"))
    if d_shape:
        named["D"] = normal(d_shape, s + 5)
    if case.param("z"):
        named["z"] = normal((b, t, h, p), s + 6)
    if case.param("softplus"):
        named["dt_bias"] = 0.5 * normal((h,), s + 7)
    if case.param("initial"):
        named["initial_states"] = 0.5 * normal((b, h, p, n), s + 8)
    segments = case.param("segments")
    seq_idx = None
    if segments:
        seq_idx = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(segments))
        seq_idx = seq_idx.to(torch.int32).expand(b, t).contiguous()
    limit = case.param("dt_limit")
    kwargs = {
        "chunk_size": case.param("chunk"),
        "seq_idx": seq_idx,
        "dt_softplus": bool(case.param("softplus")),
        "dt_limit": (0.0, float("inf")) if limit is None else tuple(map(float, limit)),
    }
    return named, kwargs


def _norm_inputs(case: MambaCase):
    s, shape = case.seed, case.param("shape")
    named = {"x": normal(shape, s), "weight": 1 + 0.3 * normal(shape[-1:], s + 1)}
    if case.param("z"):
        named["z"] = normal(shape, s + 2)
    groups = case.param("groups")
    kwargs = {
        "eps": case.param("eps"),
        "group_size": None if groups is None else shape[-1] // groups,
        "norm_before_gate": bool(case.param("norm_before_gate")),
    }
    return named, kwargs


def _moved(kwargs, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def call_operator(case: MambaCase, leaves, kwargs, kernel: str = "reference"):
    """Run the operator through ``mcore_npu.ops``: ``(out, final state or None)``."""
    from mcore_npu import ops

    named = dict(zip(kwargs["names"], leaves, strict=True))
    options = {k: v for k, v in _moved(kwargs, leaves[0].device).items() if k != "names"}
    if case.operator == "rms_norm_gated":
        return ops.rms_norm_gated(named.pop("x"), named.pop("weight"), **named, **options), None
    args = [named.pop(name) for name in SCAN_LEAVES[:5]] + [options.pop("chunk_size")]
    return ops.mamba_chunk_scan_combined(
        *args, **named, **options, return_final_states=True, kernel=kernel
    )


def oracle(case: MambaCase, leaves, kwargs):
    """The float64 answer from the definitions (differentiable): ``(out, state or None)``."""
    named = dict(zip(kwargs["names"], (t.double() for t in leaves), strict=True))
    if case.operator == "rms_norm_gated":
        return norm_oracle(**named, **{k: v for k, v in kwargs.items() if k != "names"}), None
    return scan_oracle(
        **named,
        seq_idx=kwargs["seq_idx"],
        softplus=kwargs["dt_softplus"],
        dt_limit=kwargs["dt_limit"],
    )


def scan_oracle(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    *,
    seq_idx=None,
    softplus=False,
    dt_limit=(0.0, float("inf")),
):
    """The SSD recurrence token by token in float64: ``(y [b, t, h, p], final [b, h, p, n])``;
    the state is zero where ``seq_idx`` changes (``initial_states`` reach sequence 0 only)."""
    b, t, h, p = x.shape
    heads_per_group = h // B.shape[2]
    step = dt if dt_bias is None else dt + dt_bias
    step = (F.softplus(step) if softplus else step).clamp(*dt_limit)
    zeros = x.new_zeros(b, h, p, B.shape[3])
    state = zeros if initial_states is None else initial_states
    outputs = []
    for i in range(t):
        if seq_idx is not None:
            before = seq_idx[:, i - 1] if i else torch.zeros_like(seq_idx[:, 0])
            state = torch.where((seq_idx[:, i] != before)[:, None, None, None], zeros, state)
        keys = B[:, i].repeat_interleave(heads_per_group, dim=1)  # [b, h, n]
        queries = C[:, i].repeat_interleave(heads_per_group, dim=1)
        decay = torch.exp(step[:, i] * A)[:, :, None, None]
        state = decay * state + (step[:, i, :, None] * x[:, i])[..., None] * keys[:, :, None]
        y = (state * queries[:, :, None]).sum(-1)
        if D is not None:
            y = y + (D if D.dim() == 2 else D[:, None]) * x[:, i]
        if z is not None:
            y = y * z[:, i] * torch.sigmoid(z[:, i])
        outputs.append(y)
    return torch.stack(outputs, dim=1), state


def norm_oracle(x, weight, z=None, *, eps, group_size, norm_before_gate):
    """``weight * x / rms`` per group of ``group_size`` channels, gated by ``silu(z)`` before
    the norm (``norm_before_gate=False``) or after it."""
    gate = None if z is None else z * torch.sigmoid(z)
    if gate is not None and not norm_before_gate:
        x = x * gate
    size = x.shape[-1] if group_size is None else group_size
    groups = []
    for start in range(0, x.shape[-1], size):
        part = x[..., start : start + size]
        groups.append(part / torch.sqrt((part * part).mean(-1, keepdim=True) + eps))
    y = torch.cat(groups, dim=-1) * weight
    return y * gate if gate is not None and norm_before_gate else y


def check_reference_mamba_case(case: MambaCase, device="cpu"):
    """The reference in the case's dtype against the float64 oracle (same rounded inputs)."""
    leaves, kwargs = make_call(case, case.dtype, device)
    got = call_operator(case, leaves, kwargs, "reference")
    exact, cpu_kwargs = make_call(case, case.dtype, "cpu")
    exact = [t.detach().double().requires_grad_() for t in exact]
    return compare_outputs(case, got, leaves, oracle(case, exact, cpu_kwargs), exact)


def check_kernel_mamba_case(case: MambaCase, device):
    """The kernel ``auto`` picks on ``device`` against the fp32 reference on the CPU."""
    leaves, kwargs = make_call(case, case.dtype, device)
    got = call_operator(case, leaves, kwargs, "auto")
    rounded, cpu_kwargs = make_call(case, case.dtype, "cpu")
    wide = [t.detach().float().requires_grad_() for t in rounded]
    return compare_outputs(
        case, got, leaves, call_operator(case, wide, cpu_kwargs, "reference"), wide
    )
