"""The attention operator: one entry point, two kernels.

``fusion_attention`` validates the call once (``mcore_npu.ops.validation``), then runs either
Ascend's ``torch_npu.npu_fusion_attention`` or the pure-PyTorch reference
(``mcore_npu.ops.reference``) and returns the attention output only.
``fusion_attention_with_stats`` also returns the softmax statistics (outputs 1 and 2), and
``fusion_attention_grad`` runs the explicit gradient operator ``npu_fusion_attention_grad``:
both are what ring attention (context parallelism) calls per block.

``torch_npu`` is looked up at call time with ``importlib.import_module``, never when this package
is imported, so machines without CANN import fine and tests can put a stand-in module into
``sys.modules``.
"""

from __future__ import annotations

import difflib
import importlib

import torch

from mcore_npu.ops.contract import INT32_MAX
from mcore_npu.ops.reference import AttentionOptions, npu_fusion_attention_grad, run_reference
from mcore_npu.ops.validation import validate_call

KERNELS = ("auto", "torch_npu", "reference")

__all__ = [
    "KERNELS",
    "fusion_attention",
    "fusion_attention_grad",
    "fusion_attention_with_stats",
    "grouped_linear",
    "grouped_matmul",
    "load_torch_npu",
    "moe_token_permute",
    "moe_token_permute_with_routing_map",
    "moe_token_unpermute",
    "moe_token_unpermute_with_routing_map",
    "resolve_kernel",
    "rms_norm",
    "rotary_mul",
    "swiglu",
]


def resolve_kernel(kernel: str, device: torch.device) -> str:
    """``"auto"`` -> ``"torch_npu"`` for tensors on an NPU, ``"reference"`` elsewhere."""
    if kernel not in KERNELS:
        raise ValueError(
            f"kernel: unknown kernel {kernel!r}; pass one of {', '.join(KERNELS)} "
            "('auto' picks torch_npu for NPU tensors and the reference otherwise)"
        )
    if kernel == "auto":
        return "torch_npu" if device.type == "npu" else "reference"
    return kernel


def load_torch_npu():
    """Import ``torch_npu`` now, or raise an ImportError that says why and how to fix it."""
    try:
        return importlib.import_module("torch_npu")
    except Exception as err:  # ImportError, OSError and RuntimeError all occur without CANN
        raise ImportError(
            f"kernel='torch_npu' needs the torch_npu package, which failed to import: "
            f"{type(err).__name__}: {err}\n"
            "  fix: on an Ascend machine, source CANN first (source "
            "/usr/local/Ascend/ascend-toolkit/set_env.sh) and install the torch-npu build that "
            "matches your torch exactly (torch 2.6.0 -> torch-npu 2.6.0.postN, ...); elsewhere "
            "use kernel='reference' or 'auto'"
        ) from err


_OP_KEYWORDS = (
    "pse", "padding_mask", "atten_mask", "scale", "keep_prob", "pre_tockens", "next_tockens",
    "inner_precise", "prefix", "actual_seq_qlen", "actual_seq_kvlen", "sparse_mode",
    "gen_mask_parallel", "sync",
)  # fmt: skip


def _check_keywords(op_kwargs: dict) -> None:
    for name in op_kwargs:
        if name not in _OP_KEYWORDS:
            close = difflib.get_close_matches(name, _OP_KEYWORDS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(
                f"fusion_attention: unknown operator keyword {name!r}; {hint}the operator takes "
                f"{', '.join(_OP_KEYWORDS)} (note the spelling 'tockens')"
            )


def fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    kernel: str = "auto",
    **op_kwargs,
) -> torch.Tensor:
    """Fused attention with the operator's semantics; returns the output only.

    Args:
        query, key, value: tensors in ``input_layout`` (see ``npu_fusion_attention``).
        head_num: query heads on this rank (Nq).
        input_layout: ``"BSH"``, ``"SBH"``, ``"BSND"``, ``"BNSD"`` or ``"TND"``.
        kernel: ``"auto"`` (torch_npu on NPU tensors, the reference elsewhere), ``"torch_npu"``
            or ``"reference"``.
        **op_kwargs: the operator's keyword arguments (``atten_mask``, ``scale``,
            ``sparse_mode``, ...). They reach ``torch_npu.npu_fusion_attention`` exactly as given.

    Returns:
        The attention output in the query's layout with D replaced by Dv.

    Raises:
        TypeError, ValueError: the call breaks the operator contract (before any kernel runs).
        ImportError: ``kernel="torch_npu"`` and torch_npu cannot be imported (with the cause).
    """
    _check_keywords(op_kwargs)
    chosen = resolve_kernel(kernel, getattr(query, "device", torch.device("cpu")))
    problem = validate_call(query, key, value, head_num, input_layout, **op_kwargs, kernel=chosen)
    if chosen == "torch_npu":
        torch_npu = load_torch_npu()
        return torch_npu.npu_fusion_attention(
            query, key, value, head_num, input_layout, **op_kwargs
        )[0]
    return run_reference(problem, query, key, value, _options(op_kwargs), need_stats=False)[0]


def fusion_attention_with_stats(
    query, key, value, head_num: int, input_layout: str, *, kernel: str = "auto", **op_kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As :func:`fusion_attention`, returning ``(out, softmax_max, softmax_sum)``.

    The statistics are float32 ``[B, Nq, Sq, 8]`` (TND ``[Tq, Nq, 8]``): the row max of the
    scaled, masked scores and ``sum(exp(score - max))``; fully masked rows give float32 min /
    float32 max. The output keeps its autograd graph; the statistics are detached.
    """
    _check_keywords(op_kwargs)
    chosen = resolve_kernel(kernel, getattr(query, "device", torch.device("cpu")))
    problem = validate_call(query, key, value, head_num, input_layout, **op_kwargs, kernel=chosen)
    if chosen == "torch_npu":
        result = load_torch_npu().npu_fusion_attention(
            query, key, value, head_num, input_layout, **op_kwargs
        )
        return result[0], result[1], result[2]
    return run_reference(problem, query, key, value, _options(op_kwargs), need_stats=True)


_GRAD_KEYWORDS = tuple(name for name in _OP_KEYWORDS if name != "scale") + (
    "scale_value", "softmax_max", "softmax_sum", "softmax_in", "attention_in", "seed", "offset",
    "numels",
)  # fmt: skip


def fusion_attention_grad(
    query, key, value, dy, head_num: int, input_layout: str, *, kernel: str = "auto", **op_kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gradient operator ``npu_fusion_attention_grad`` through the kernel switch.

    Args:
        query, key, value, dy, head_num, input_layout: as the operator (dy: the output's shape).
        kernel: ``"auto"``, ``"torch_npu"`` or ``"reference"`` (as :func:`fusion_attention`).
        **op_kwargs: the operator's keywords exactly as torch_npu spells them (``scale_value``,
            ``softmax_max``, ``softmax_sum``, ``attention_in``, ``atten_mask``, ...).

    Returns:
        ``(dq, dk, dv, dpse)`` in the layouts of query/key/value; dpse is None without ``pse``
        (some torch_npu releases return more values; only these are kept).
    """
    for name in op_kwargs:
        if name not in _GRAD_KEYWORDS:
            close = difflib.get_close_matches(name, _GRAD_KEYWORDS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(
                f"fusion_attention_grad: unknown operator keyword {name!r}; {hint}the gradient "
                f"operator takes {', '.join(_GRAD_KEYWORDS)} (the scale is 'scale_value' here)"
            )
    chosen = resolve_kernel(kernel, getattr(query, "device", torch.device("cpu")))
    if chosen == "torch_npu":
        result = load_torch_npu().npu_fusion_attention_grad(
            query, key, value, dy, head_num, input_layout, **op_kwargs
        )
    else:
        result = npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout,
                                           **op_kwargs)  # fmt: skip
    dpse = result[3] if op_kwargs.get("pse") is not None else None
    return result[0], result[1], result[2], dpse


def _options(op_kwargs: dict) -> AttentionOptions:
    return AttentionOptions(
        pse=op_kwargs.get("pse"),
        atten_mask=op_kwargs.get("atten_mask"),
        scale=float(op_kwargs.get("scale", 1.0)),
        keep_prob=float(op_kwargs.get("keep_prob", 1.0)),
        pre_tokens=op_kwargs.get("pre_tockens", INT32_MAX),
        next_tokens=op_kwargs.get("next_tockens", INT32_MAX),
        prefix=op_kwargs.get("prefix"),
        sparse_mode=op_kwargs.get("sparse_mode", 0),
    )


# The fused operators beyond attention (they use resolve_kernel / load_torch_npu from above).
from mcore_npu.ops.fused import grouped_linear, grouped_matmul, rms_norm, swiglu  # noqa: E402
from mcore_npu.ops.fused_rotary import rotary_mul  # noqa: E402

# The MoE token permute operators (fused MoE permute; auto falls back to the unfused path).
from mcore_npu.ops.permute_dispatch import (  # noqa: E402
    moe_token_permute,
    moe_token_permute_with_routing_map,
    moe_token_unpermute,
    moe_token_unpermute_with_routing_map,
)
