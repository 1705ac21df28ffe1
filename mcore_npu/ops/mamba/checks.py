"""Argument checks of the Mamba2 operators: a ``TypeError`` / ``ValueError`` that names the
operator, the argument, what was received and the fix (``mcore_npu.ops._checks``)."""

from __future__ import annotations

import math

import torch

from mcore_npu.ops._checks import check_tensor, fail, is_int, is_real

SCAN = "mamba_chunk_scan_combined"


def validate_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit):
    """Check one ``mamba_chunk_scan_combined`` call (mamba_ssm's shapes)."""
    shown = [
        (n, t) for n, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)) if t is not None
    ]
    for name, t in shown:
        check_tensor(SCAN, name, t, "reference", shown)
    if x.dim() != 4:
        fail(
            SCAN,
            ValueError,
            "x",
            f"rank {x.dim()}, expected 4",
            "pass x as [batch, tokens, heads, headdim]",
            shown,
        )
    b, t, h, p = x.shape
    _shape(dt, (b, t, h), "dt", "pass dt as [batch, tokens, heads]", shown)
    _shape(A, (h,), "A", "pass A as [heads] (Mamba2's -exp(A_log))", shown)
    if B.dim() != 4 or B.shape[:2] != (b, t):
        fail(
            SCAN,
            ValueError,
            "B",
            f"shape {list(B.shape)}, expected [{b}, {t}, groups, dstate]",
            "pass B as [batch, tokens, groups, dstate]",
            shown,
        )
    _shape(C, tuple(B.shape), "C", "pass C with B's shape [batch, tokens, groups, dstate]", shown)
    if h % B.shape[2]:
        fail(
            SCAN,
            ValueError,
            "B",
            f"{B.shape[2]} groups do not divide {h} heads",
            "pass a group count that divides the heads",
            shown,
        )
    if not is_int(chunk_size) or chunk_size < 1:
        fail(
            SCAN,
            ValueError,
            "chunk_size",
            f"expected a positive int, got {chunk_size!r}",
            "pass e.g. 128 or 256",
            shown,
        )
    if bool((A.detach() > 0).any()):
        fail(
            SCAN,
            ValueError,
            "A",
            "has positive entries: the state would grow without bound",
            "pass A <= 0 (Mamba2's -exp(A_log))",
            shown,
        )
    _optional(D, ((h,), (h, p)), "D", "pass D as [heads] or [heads, headdim]", shown)
    _optional(z, (tuple(x.shape),), "z", "pass z with x's shape", shown)
    _optional(dt_bias, ((h,),), "dt_bias", "pass dt_bias as [heads]", shown)
    n = B.shape[3]
    _optional(
        initial_states,
        ((b, h, p, n),),
        "initial_states",
        "pass [batch, heads, headdim, dstate]",
        shown,
    )
    _check_seq_idx(seq_idx, b, t, shown)
    _check_limit(dt_limit, shown)


def _shape(tensor, want, name, fix, shown) -> None:
    if tuple(tensor.shape) != tuple(want):
        fail(
            SCAN, ValueError, name, f"shape {list(tensor.shape)}, expected {list(want)}", fix, shown
        )


def _optional(tensor, allowed, name, fix, shown) -> None:
    if tensor is None:
        return
    check_tensor(SCAN, name, tensor, "reference", shown)
    if tuple(tensor.shape) not in allowed:
        want = " or ".join(str(list(a)) for a in allowed)
        fail(SCAN, ValueError, name, f"shape {list(tensor.shape)}, expected {want}", fix, shown)


def _check_seq_idx(seq_idx, b, t, shown) -> None:
    if seq_idx is None:
        return
    if (
        not isinstance(seq_idx, torch.Tensor)
        or seq_idx.dtype.is_floating_point
        or seq_idx.dtype == torch.bool
    ):
        got = seq_idx.dtype if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__
        fail(
            SCAN,
            TypeError,
            "seq_idx",
            f"expected an integer tensor, got {got}",
            "pass seq_idx as int32 [batch, tokens]",
            shown,
        )
    if tuple(seq_idx.shape) != (b, t):
        fail(
            SCAN,
            ValueError,
            "seq_idx",
            f"shape {list(seq_idx.shape)}, expected [{b}, {t}]",
            "pass one sequence index per token",
            shown,
        )
    if t > 1 and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
        fail(
            SCAN,
            ValueError,
            "seq_idx",
            "decreases along a row",
            "number the packed sequences 0, 1, 2, ... in token order",
            shown,
        )


def _check_limit(dt_limit, shown) -> None:
    ok = isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2 and all(map(is_real, dt_limit))
    if not ok or math.isnan(dt_limit[0]) or math.isnan(dt_limit[1]) or dt_limit[0] > dt_limit[1]:
        fail(
            SCAN,
            ValueError,
            "dt_limit",
            f"expected (low, high) with low <= high, got {dt_limit!r}",
            "pass e.g. (0.0, float('inf'))",
            shown,
        )
