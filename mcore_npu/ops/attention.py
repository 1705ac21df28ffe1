"""The attention operator: ``fusion_attention`` (the output), ``fusion_attention_with_stats``
(also the softmax statistics, outputs 1 and 2) and ``fusion_attention_grad`` (the explicit
gradient operator): what ``NPUFusionAttention`` and ring attention call. Each validates the call
once (``mcore_npu.ops.validation``), then runs the kernel the registry picks
(``mcore_npu.ops.registry``): ``torch_npu.npu_fusion_attention`` or the reference.
"""

from __future__ import annotations

import difflib

import torch

from mcore_npu.ops import registry
from mcore_npu.ops.attention_grad import npu_fusion_attention_grad
from mcore_npu.ops.attention_reference import AttentionOptions, run_reference
from mcore_npu.ops.contract import INT32_MAX
from mcore_npu.ops.validation import validate_call

__all__ = ["fusion_attention", "fusion_attention_grad", "fusion_attention_with_stats"]


def _device(t):
    return getattr(t, "device", torch.device("cpu"))


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
    chosen = registry.resolve("fusion_attention", kernel, _device(query)).kernel
    problem = validate_call(query, key, value, head_num, input_layout, **op_kwargs, kernel=chosen)
    if chosen == "torch_npu":
        op = registry.ascend("fusion_attention")
        return op(query, key, value, head_num, input_layout, **op_kwargs)[0]
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
    chosen = registry.resolve("fusion_attention", kernel, _device(query)).kernel
    problem = validate_call(query, key, value, head_num, input_layout, **op_kwargs, kernel=chosen)
    if chosen == "torch_npu":
        op = registry.ascend("fusion_attention")
        result = op(query, key, value, head_num, input_layout, **op_kwargs)
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
    chosen = registry.resolve("fusion_attention_grad", kernel, _device(query)).kernel
    if chosen == "torch_npu":
        op = registry.ascend("fusion_attention_grad")
        result = op(query, key, value, dy, head_num, input_layout, **op_kwargs)
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
