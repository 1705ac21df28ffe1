"""Argument checks of the Gated DeltaNet operators (before any kernel runs).

Every failure raises ``TypeError`` (wrong type) or ``ValueError`` (wrong value) naming the
operator and the argument, showing what was received and ending with ``fix: ...``
(``mcore_npu.ops._checks``).
"""

from __future__ import annotations

import math

import torch

from mcore_npu.ops._checks import check_tensor, fail, is_real

RULE = "chunk_gated_delta_rule"
CONV = "causal_conv1d"


def _check_flag(op: str, name: str, value) -> None:
    if not isinstance(value, bool):
        problem = f"expected a bool, got {type(value).__name__} {value!r}"
        fail(op, TypeError, name, problem, f"pass {name}=True or {name}=False")


def validate_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    use_qk_l2norm_in_kernel,
    kernel: str = "reference",
) -> list[int]:
    """Check one ``chunk_gated_delta_rule`` call; returns the segment bounds ``[0, ..., T]``."""
    shown = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))
    for name, t in shown:
        check_tensor(RULE, name, t, kernel, shown)
    for name, t, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if t.dim() != rank:
            layout = "[B, T, HV]" if rank == 3 else "[B, T, heads, head_dim]"
            problem = f"rank {t.dim()}, expected {rank} ({layout})"
            fix = f"reshape {name} to {layout} (fla's layout, batch first)"
            fail(RULE, ValueError, name, problem, fix, shown)
        if t.device != q.device:
            problem = f"is on {t.device} but q is on {q.device}"
            fail(RULE, ValueError, name, problem, "move every input to one device", shown)
    _check_shapes(q, k, v, g, beta, shown)
    _check_scale(scale)
    _check_flag(RULE, "output_final_state", output_final_state)
    _check_flag(RULE, "use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    bounds = check_cu_seqlens(RULE, cu_seqlens, batch=q.shape[0], tokens=q.shape[1])
    _check_initial_state(initial_state, q, v, len(bounds) - 1 if cu_seqlens is not None else None)
    return bounds


def _check_shapes(q, k, v, g, beta, shown) -> None:
    if k.shape != q.shape:
        problem = f"shape {list(k.shape)} differs from q's {list(q.shape)}"
        fail(RULE, ValueError, "k", problem, "give q and k the same [B, T, H, K] shape", shown)
    if v.shape[:2] != q.shape[:2]:
        problem = f"batch/length {list(v.shape[:2])} differ from q's {list(q.shape[:2])}"
        fix = "give v the shape [B, T, HV, V] with q's B and T"
        fail(RULE, ValueError, "v", problem, fix, shown)
    heads, value_heads = q.shape[2], v.shape[2]
    if heads == 0 or value_heads % heads:
        problem = f"{value_heads} value heads are not a multiple of the {heads} q/k heads"
        fix = "use HV = a multiple of H "
        fix += "(grouped value attention: value head h reads q/k head h // (HV // H))"
        fail(RULE, ValueError, "v", problem, fix, shown)
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != v.shape[:3]:
            problem = f"shape {list(t.shape)} is not v's [B, T, HV] {list(v.shape[:3])}"
            fix = f"give {name} one value per token and value head"
            fail(RULE, ValueError, name, problem, fix, shown)


def _check_scale(scale) -> None:
    if scale is None:
        return
    if not is_real(scale):
        problem = f"expected a real number or None, got {type(scale).__name__}"
        fail(RULE, TypeError, "scale", problem, "pass a float such as K ** -0.5, or None for it")
    if not math.isfinite(scale) or scale <= 0:
        problem = f"must be finite and > 0, got {scale!r}"
        fix = "pass a positive float such as K ** -0.5, or None for it"
        fail(RULE, ValueError, "scale", problem, fix)


def _check_initial_state(initial_state, q, v, segments) -> None:
    if initial_state is None:
        return
    if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
        is_tensor = isinstance(initial_state, torch.Tensor)
        got = initial_state.dtype if is_tensor else initial_state
        fix = "pass a float32 tensor [B or N, HV, K, V] or None"
        fail(RULE, TypeError, "initial_state", f"expected a floating tensor, got {got}", fix)
    rows = q.shape[0] if segments is None else segments
    want = [rows, v.shape[2], q.shape[3], v.shape[3]]
    if list(initial_state.shape) != want:
        what = "N = len(cu_seqlens) - 1 segments" if segments is not None else "B"
        problem = f"shape {list(initial_state.shape)}, expected {want} ([{what}, HV, K, V])"
        per = "segment" if segments is not None else "batch row"
        fix = f"pass one [HV, K, V] state per {per}, or None for zeros"
        shown = (("initial_state", initial_state), ("q", q), ("v", v))
        fail(RULE, ValueError, "initial_state", problem, fix, shown)
    if initial_state.device != q.device:
        problem = f"is on {initial_state.device} but q is on {q.device}"
        fail(RULE, ValueError, "initial_state", problem, "move it to q's device")


def check_cu_seqlens(op: str, cu_seqlens, *, batch: int, tokens: int) -> list[int]:
    """``cu_seqlens`` is None or int ``[N + 1]`` (0, ascending, ending at T; B == 1); returns
    the bounds as Python ints (one host read)."""
    if cu_seqlens is None:
        return [0, tokens]
    is_tensor = isinstance(cu_seqlens, torch.Tensor)
    if not is_tensor or cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        got = getattr(cu_seqlens, "dtype", type(cu_seqlens).__name__)
        fix = "pass torch.tensor([0, len_1, len_1 + len_2, ...], dtype=torch.int32)"
        fail(op, TypeError, "cu_seqlens", f"expected an integer tensor, got {got}", fix)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        problem = f"shape {list(cu_seqlens.shape)}, expected [N + 1] with N >= 1"
        fix = "pass the cumulative segment lengths, starting at 0"
        fail(op, ValueError, "cu_seqlens", problem, fix)
    if batch != 1:
        problem = f"packed segments need batch 1, got B = {batch}"
        fix = "flatten the batch into one row [1, total_tokens, ...] (thd)"
        fail(op, ValueError, "cu_seqlens", problem, fix)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != tokens or any(b < a for a, b in zip(bounds, bounds[1:])):
        problem = f"{bounds} must start at 0, never decrease and end at T = {tokens}"
        fix = "pass cumsum of the segment lengths with a leading 0"
        fail(op, ValueError, "cu_seqlens", problem, fix)
    return bounds


def validate_conv(x, weight, cu_seqlens, bias=None) -> list[int]:
    """Check one ``causal_conv1d`` call; returns the segment bounds."""
    shown = (("x", x), ("weight", weight))
    check_tensor(CONV, "x", x, "reference", shown)
    check_tensor(CONV, "weight", weight, "reference", shown)
    if x.dim() != 3:
        problem = f"rank {x.dim()}, expected 3 ([B, T, C])"
        fail(CONV, ValueError, "x", problem, "pass x as [batch, tokens, channels]", shown)
    if weight.dim() != 3 or weight.shape[:2] != (x.shape[2], 1) or weight.shape[2] < 1:
        problem = f"shape {list(weight.shape)}, expected [{x.shape[2]}, 1, W] "
        problem += "(depthwise, x's C channels)"
        fix = "pass Megatron's conv1d.weight [C, 1, kernel_width]"
        fail(CONV, ValueError, "weight", problem, fix, shown)
    if bias is not None:
        check_tensor(CONV, "bias", bias, "reference", shown)
        if tuple(bias.shape) != (x.shape[2],):
            problem = f"shape {list(bias.shape)}, expected [{x.shape[2]}]"
            fail(
                CONV, ValueError, "bias", problem, "pass Megatron's conv1d.bias [C], or None", shown
            )
    return check_cu_seqlens(CONV, cu_seqlens, batch=x.shape[0], tokens=x.shape[1])
