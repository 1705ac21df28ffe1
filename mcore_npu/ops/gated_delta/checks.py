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
        fail(op, TypeError, name, f"expected a bool, got {type(value).__name__} {value!r}",
             f"pass {name}=True or {name}=False")  # fmt: skip


def validate_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
                  use_qk_l2norm_in_kernel, kernel: str = "reference") -> list[int]:  # fmt: skip
    """Check one ``chunk_gated_delta_rule`` call; returns the segment bounds ``[0, ..., T]``."""
    shown = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))
    for name, t in shown:
        check_tensor(RULE, name, t, kernel, shown)
    for name, t, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if t.dim() != rank:
            layout = "[B, T, HV]" if rank == 3 else "[B, T, heads, head_dim]"
            fail(RULE, ValueError, name, f"rank {t.dim()}, expected {rank} ({layout})",
                 f"reshape {name} to {layout} (fla's layout, batch first)", shown)  # fmt: skip
        if t.device != q.device:
            fail(RULE, ValueError, name, f"is on {t.device} but q is on {q.device}",
                 "move every input to one device", shown)  # fmt: skip
    _check_shapes(q, k, v, g, beta, shown)
    _check_scale(scale)
    _check_flag(RULE, "output_final_state", output_final_state)
    _check_flag(RULE, "use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    bounds = check_cu_seqlens(RULE, cu_seqlens, batch=q.shape[0], tokens=q.shape[1])
    _check_initial_state(initial_state, q, v, len(bounds) - 1 if cu_seqlens is not None else None)
    return bounds


def _check_shapes(q, k, v, g, beta, shown) -> None:
    if k.shape != q.shape:
        fail(RULE, ValueError, "k", f"shape {list(k.shape)} differs from q's {list(q.shape)}",
             "give q and k the same [B, T, H, K] shape", shown)  # fmt: skip
    if v.shape[:2] != q.shape[:2]:
        fail(RULE, ValueError, "v", f"batch/length {list(v.shape[:2])} differ from q's "
             f"{list(q.shape[:2])}", "give v the shape [B, T, HV, V] with q's B and T",
             shown)  # fmt: skip
    heads, value_heads = q.shape[2], v.shape[2]
    if heads == 0 or value_heads % heads:
        fail(RULE, ValueError, "v", f"{value_heads} value heads are not a multiple of the "
             f"{heads} q/k heads", "use HV = a multiple of H (grouped value attention: value "
             "head h reads q/k head h // (HV // H))", shown)  # fmt: skip
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != v.shape[:3]:
            fail(RULE, ValueError, name, f"shape {list(t.shape)} is not v's [B, T, HV] "
                 f"{list(v.shape[:3])}", f"give {name} one value per token and value head",
                 shown)  # fmt: skip


def _check_scale(scale) -> None:
    if scale is None:
        return
    if not is_real(scale):
        fail(RULE, TypeError, "scale", f"expected a real number or None, got "
             f"{type(scale).__name__}", "pass a float such as K ** -0.5, or None for it")  # fmt: skip
    if not math.isfinite(scale) or scale <= 0:
        fail(RULE, ValueError, "scale", f"must be finite and > 0, got {scale!r}",
             "pass a positive float such as K ** -0.5, or None for it")  # fmt: skip


def _check_initial_state(initial_state, q, v, segments) -> None:
    if initial_state is None:
        return
    if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
        fail(RULE, TypeError, "initial_state", f"expected a floating tensor, got "
             f"{initial_state if not isinstance(initial_state, torch.Tensor) else initial_state.dtype}",
             "pass a float32 tensor [B or N, HV, K, V] or None")  # fmt: skip
    rows = q.shape[0] if segments is None else segments
    want = [rows, v.shape[2], q.shape[3], v.shape[3]]
    if list(initial_state.shape) != want:
        what = "N = len(cu_seqlens) - 1 segments" if segments is not None else "B"
        fail(RULE, ValueError, "initial_state", f"shape {list(initial_state.shape)}, expected "
             f"{want} ([{what}, HV, K, V])", "pass one [HV, K, V] state per "
             + ("segment" if segments is not None else "batch row") + ", or None for zeros",
             (("initial_state", initial_state), ("q", q), ("v", v)))  # fmt: skip
    if initial_state.device != q.device:
        fail(RULE, ValueError, "initial_state", f"is on {initial_state.device} but q is on "
             f"{q.device}", "move it to q's device")  # fmt: skip


def check_cu_seqlens(op: str, cu_seqlens, *, batch: int, tokens: int) -> list[int]:
    """``cu_seqlens`` is None or int ``[N + 1]``: 0, ascending, ending at T, with B == 1.

    Returns the bounds as Python ints (one host read).
    """
    if cu_seqlens is None:
        return [0, tokens]
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_floating_point() \
            or cu_seqlens.dtype == torch.bool:  # fmt: skip
        fail(op, TypeError, "cu_seqlens", f"expected an integer tensor, got "
             f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}",
             "pass torch.tensor([0, len_1, len_1 + len_2, ...], dtype=torch.int32)")  # fmt: skip
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        fail(op, ValueError, "cu_seqlens", f"shape {list(cu_seqlens.shape)}, expected [N + 1] "
             "with N >= 1", "pass the cumulative segment lengths, starting at 0")  # fmt: skip
    if batch != 1:
        fail(op, ValueError, "cu_seqlens", f"packed segments need batch 1, got B = {batch}",
             "flatten the batch into one row [1, total_tokens, ...] (thd)")  # fmt: skip
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != tokens or any(b < a for a, b in zip(bounds, bounds[1:])):
        fail(op, ValueError, "cu_seqlens", f"{bounds} must start at 0, never decrease and end "
             f"at T = {tokens}", "pass cumsum of the segment lengths with a leading 0")  # fmt: skip
    return bounds


def validate_conv(x, weight, cu_seqlens) -> list[int]:
    """Check one ``causal_conv1d`` call; returns the segment bounds."""
    shown = (("x", x), ("weight", weight))
    check_tensor(CONV, "x", x, "reference", shown)
    check_tensor(CONV, "weight", weight, "reference", shown)
    if x.dim() != 3:
        fail(CONV, ValueError, "x", f"rank {x.dim()}, expected 3 ([B, T, C])",
             "pass x as [batch, tokens, channels]", shown)  # fmt: skip
    if weight.dim() != 3 or weight.shape[:2] != (x.shape[2], 1) or weight.shape[2] < 1:
        fail(CONV, ValueError, "weight", f"shape {list(weight.shape)}, expected "
             f"[{x.shape[2]}, 1, W] (depthwise, x's C channels)",
             "pass Megatron's conv1d.weight [C, 1, kernel_width]", shown)  # fmt: skip
    return check_cu_seqlens(CONV, cu_seqlens, batch=x.shape[0], tokens=x.shape[1])
