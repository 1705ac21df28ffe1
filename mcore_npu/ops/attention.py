"""The attention operator as ``NPUFusionAttention`` and ring attention call it:
``fusion_attention`` (the output), ``fusion_attention_with_stats`` (also the softmax statistics)
and ``fusion_attention_grad`` (the gradient operator), each validated once, then run on the
kernel the registry picks: ``torch_npu.npu_fusion_attention`` or the reference.
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


_OP_KEYWORDS = ("pse", "padding_mask", "atten_mask", "scale", "keep_prob", "pre_tockens")
_OP_KEYWORDS += ("next_tockens", "inner_precise", "prefix", "actual_seq_qlen", "actual_seq_kvlen")
_OP_KEYWORDS += ("sparse_mode", "gen_mask_parallel", "sync")


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
    """Fused attention with the operator's semantics; returns the output only (query layout,
    D replaced by Dv). ``op_kwargs`` (``atten_mask``, ``scale``, ...) reach the kernel as given."""
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
    """As :func:`fusion_attention`, returning ``(out, softmax_max, softmax_sum)``: float32
    ``[B, Nq, Sq, 8]`` (TND ``[Tq, Nq, 8]``), fully masked rows float32 min / max, detached."""
    _check_keywords(op_kwargs)
    chosen = registry.resolve("fusion_attention", kernel, _device(query)).kernel
    problem = validate_call(query, key, value, head_num, input_layout, **op_kwargs, kernel=chosen)
    if chosen == "torch_npu":
        op = registry.ascend("fusion_attention")
        result = op(query, key, value, head_num, input_layout, **op_kwargs)
        return result[0], result[1], result[2]
    return run_reference(problem, query, key, value, _options(op_kwargs), need_stats=True)


_GRAD_KEYWORDS = tuple(name for name in _OP_KEYWORDS if name != "scale")
_GRAD_KEYWORDS += ("scale_value", "softmax_max", "softmax_sum", "softmax_in", "attention_in")
_GRAD_KEYWORDS += ("seed", "offset", "numels")


def fusion_attention_grad(
    query, key, value, dy, head_num: int, input_layout: str, *, kernel: str = "auto", **op_kwargs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``npu_fusion_attention_grad`` on the chosen kernel, keywords as torch_npu spells them:
    ``(dq, dk, dv, dpse)`` in the layouts of query/key/value, dpse None without ``pse``."""
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
        args = (query, key, value, dy, head_num, input_layout)
        result = npu_fusion_attention_grad(*args, **op_kwargs)
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
