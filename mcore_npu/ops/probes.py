"""Capability probes of the Ascend kernels, as the operator registry calls them:
``probe(kernel, **facts) -> reason | None`` (None: the kernel can take the call). They read
signatures and shapes, never versions."""

from __future__ import annotations

import inspect

from mcore_npu.ops import npu_grouped_matmul as gmm

ROTARY_OLD_HEAD_DIM = 128  # the only D a torch_npu without rotary_mode takes (6.0.x)


def _parameters(op, fallback):
    """``op``'s parameters; a builtin without an introspectable signature, or one taking
    ``**kwargs``, is taken to be a newer release (``fallback``'s)."""
    try:
        params = inspect.signature(op).parameters
    except (TypeError, ValueError):
        return inspect.signature(fallback).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return inspect.signature(fallback).parameters
    return params


def rotary_mul_takes_mode(op) -> bool:
    """Whether ``op`` (torch_npu's npu_rotary_mul) takes ``rotary_mode``."""
    from mcore_npu.ops.rotary import npu_rotary_mul

    return "rotary_mode" in _parameters(op, npu_rotary_mul)


def rotary_mul(op, *, rotary_mode="half", head_dim=None, **_facts) -> str | None:
    """torch_npu 6.0.x's ``npu_rotary_mul`` has no ``rotary_mode`` ("half" only) and takes
    D = 128 only."""
    if rotary_mul_takes_mode(op):
        return None
    if rotary_mode != "half":
        need = f"rotary_mode {rotary_mode!r} needs an npu_rotary_mul that takes rotary_mode; "
        return need + "the installed one does not (a 6.0.x release): upgrade torch-npu"
    if head_dim is not None and head_dim != ROTARY_OLD_HEAD_DIM:
        old = "the installed npu_rotary_mul (no rotary_mode: a 6.0.x release) needs D = 128, "
        return old + f"got D = {head_dim}: upgrade torch-npu"
    return None


def grouped_matmul_keywords(op) -> frozenset[str]:
    """The keyword names ``op`` (torch_npu's npu_grouped_matmul) accepts."""
    params = _parameters(op, gmm.npu_grouped_matmul)
    return frozenset(name for name in params if name not in ("x", "weight"))


def grouped_matmul(op, *, keywords=(), **_facts) -> str | None:
    """Older ``npu_grouped_matmul`` releases (torch 2.1/2.2 builds) stop at ``group_list``,
    ``split_item``, ``output_dtype``."""
    accepted = grouped_matmul_keywords(op)
    missing = sorted(k for k in keywords if k not in accepted)
    if missing:
        return f"the installed npu_grouped_matmul takes no {missing}: upgrade torch-npu"
    return None


def gated_delta_torch_npu(_op, *, grad=False, q=None, v=None, **_facts) -> str | None:
    """torch_npu's ``npu_chunk_gated_delta_rule`` is forward only, bf16, K = V = 128, <= 64
    value heads."""
    from mcore_npu.ops.gated_delta import kernels

    if grad:
        return "it is forward only (no derivative) and this call needs gradients"
    return None if q is None else kernels.torch_npu_unsupported(q, v)


def gated_delta_fla_npu(
    blocks, *, q=None, v=None, initial_state=None, output_final_state=False, **_facts
) -> str | None:
    """fla_npu's Ascend C chain: every building block present; fp16/bf16, K = 128, V in
    128/256, no gradient through the states."""
    from mcore_npu.ops.gated_delta import fla_npu_chain

    missing = [name for name in fla_npu_chain.OPS if not callable(getattr(blocks, name, None))]
    if missing:
        return f"the installed fla_npu has no {', '.join(missing)}"
    if q is None:
        return None
    return fla_npu_chain.unsupported(q, v, initial_state, output_final_state)


def masked_causal_conv1d(_op, *, width=None, dtype=None, grad=False, **_facts) -> str | None:
    """torch_npu's ``npu_masked_causal_conv1d``: kernel width 3, fp16 / bf16, documented for
    inference (no public backward)."""
    if grad:
        return "torch_npu documents it for inference (no backward) and this call needs gradients"
    if width is not None and width != 3:
        return f"it takes kernel width 3 only, this conv has width {width}"
    if dtype is not None and dtype not in ("float16", "bfloat16"):
        return f"it takes float16 / bfloat16 only, got {dtype}"
    return None
