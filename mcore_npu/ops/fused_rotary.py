"""Dispatch of ``npu_rotary_mul`` (fused RoPE): ``kernel = auto | torch_npu | reference``.

:func:`rotary_mul` validates the call (the same checks for both kernels), then runs
``torch_npu.npu_rotary_mul`` or :func:`mcore_npu.ops.rotary.npu_rotary_mul` with exactly the
documented arguments. ``torch_npu`` is imported at call time only. Older releases (6.0.x) have
no ``rotary_mode`` and need D = 128: the installed operator's signature is probed (never its
version).
"""

from __future__ import annotations

import inspect

import torch

from mcore_npu.ops import rotary


def rotary_mul(x, r1, r2, rotary_mode="half", *, kernel="auto") -> torch.Tensor:
    """``npu_rotary_mul(x, r1, r2, rotary_mode)``: x [A, B, C, D] -> [A, B, C, D] (RoPE).

    ``r1`` = cos, ``r2`` = sin, broadcastable to x (S11D for SBND). A torch_npu whose operator
    has no ``rotary_mode`` (6.0.x releases) gets ``(x, r1, r2)`` only, which is ``"half"``, and
    needs D = 128; ``"interleave"`` or another D there raise ValueError before the call.
    """
    from mcore_npu.ops import load_torch_npu, resolve_kernel

    chosen = resolve_kernel(kernel, getattr(x, "device", torch.device("cpu")))
    rotary.validate_rotary_mul(x, r1, r2, rotary_mode, kernel=chosen)
    if chosen != "torch_npu":
        return rotary.npu_rotary_mul(x, r1, r2, rotary_mode)
    op = load_torch_npu().npu_rotary_mul
    if rotary_mul_takes_mode(op):
        return op(x, r1, r2, rotary_mode=rotary_mode)
    if rotary_mode != "half":
        raise ValueError(
            f"rotary_mode: {rotary_mode!r} needs a torch_npu whose npu_rotary_mul takes "
            "rotary_mode (the installed one does not: a 6.0.x release); upgrade torch-npu, or "
            "pass kernel='reference' (rope_kernel='reference' or 'off' in the spec)"
        )
    if x.shape[-1] != 128:
        raise ValueError(
            f"input: the installed torch_npu's npu_rotary_mul (no rotary_mode: a 6.0.x release) "
            f"needs D = 128, got D = {x.shape[-1]}; upgrade torch-npu, or pass "
            "kernel='reference' (rope_kernel='reference' or 'off' in the spec)"
        )
    return op(x, r1, r2)


def rotary_mul_takes_mode(op) -> bool:
    """Whether ``op`` (torch_npu's npu_rotary_mul) takes ``rotary_mode``, from its signature.

    A builtin without an introspectable signature is taken to be a newer release (it does).
    """
    try:
        params = inspect.signature(op).parameters
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return "rotary_mode" in params
