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


def lightning_indexer(_op, *, query=None, key=None, layout="BSND", **_facts) -> str | None:
    """npu_lightning_indexer: fp16/bf16, D = 128, one key head, at most 64 query heads (TND:
    exactly 64)."""
    from mcore_npu.ops import dsa

    if query is None:
        return None
    if str(query.dtype) not in ("torch.float16", "torch.bfloat16"):
        return f"it takes float16/bfloat16, got {str(query.dtype).removeprefix('torch.')}"
    if query.shape[-1] != dsa.INDEXER_HEAD_DIM:
        return f"it takes D = {dsa.INDEXER_HEAD_DIM}, got D = {query.shape[-1]}"
    heads = query.shape[-2]
    if heads > dsa.INDEXER_MAX_HEADS or (layout == "TND" and heads != dsa.INDEXER_MAX_HEADS):
        limit = "exactly 64 in TND" if layout == "TND" else "at most 64"
        return f"it takes {limit} query heads, got {heads}"
    return None


def sparse_flash_attention(
    _op, *, query=None, key=None, query_rope=None, attention_mode=2, grad=False, **_facts
) -> str | None:
    """npu_sparse_flash_attention: fp16/bf16, one KV head, D = 512 plus a 64-wide rope part,
    a power-of-two query head count (per rank) up to 128; training needs attention_mode=2."""
    from mcore_npu.ops import dsa

    if query is None:
        return None
    if str(query.dtype) not in ("torch.float16", "torch.bfloat16"):
        return f"it takes float16/bfloat16, got {str(query.dtype).removeprefix('torch.')}"
    if key is not None and key.shape[-2] != 1:
        return f"it takes one KV head, got {key.shape[-2]}"
    if query.shape[-1] != dsa.SFA_HEAD_DIM:
        return f"it takes D = {dsa.SFA_HEAD_DIM}, got D = {query.shape[-1]}"
    if query_rope is None or query_rope.shape[-1] != dsa.SFA_ROPE_DIM:
        got = "none" if query_rope is None else query_rope.shape[-1]
        return f"it takes a rope part of {dsa.SFA_ROPE_DIM}, got {got}"
    heads = query.shape[-2]
    if heads & (heads - 1) or heads > 128:
        return f"it takes a power-of-two query head count up to 128, got {heads}"
    if grad and attention_mode != 2:
        return f"its gradient needs attention_mode=2 (absorbed MLA), got {attention_mode}"
    return None


KL_LOSS_HEADS, KL_LOSS_INDEX_HEADS = (32, 64, 128), (8, 16, 32, 64)
KL_LOSS_TOPK = (1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192)


def sparse_lightning_indexer_grad_kl_loss(
    _op,
    *,
    query=None,
    query_index=None,
    query_rope=None,
    sparse_count=None,
    heads_split=False,
    **_facts,
) -> str | None:
    """npu_sparse_lightning_indexer_grad_kl_loss: fp16/bf16, D = 512 with a 64-wide rope part,
    N1 in 32/64/128, indexer heads in 8/16/32/64, top-k a multiple of 1024 up to 8192; the
    heads on one rank (its target sums the heads it is given)."""
    if heads_split:
        return "it sums one rank's heads; under tensor parallelism the target sums every rank's"
    if query is None:
        return None
    if str(query.dtype) not in ("torch.float16", "torch.bfloat16"):
        return f"it takes float16/bfloat16, got {str(query.dtype).removeprefix('torch.')}"
    if query.shape[-1] != 512 or query_rope is None or query_rope.shape[-1] != 64:
        return "it takes D = 512 with a rope part of 64"
    if query.shape[-2] not in KL_LOSS_HEADS:
        return f"it takes 32, 64 or 128 query heads, got {query.shape[-2]}"
    if query_index is not None and query_index.shape[-2] not in KL_LOSS_INDEX_HEADS:
        return f"it takes 8, 16, 32 or 64 indexer heads, got {query_index.shape[-2]}"
    if sparse_count is not None and sparse_count not in KL_LOSS_TOPK:
        return f"it takes a top-k in {list(KL_LOSS_TOPK)}, got {sparse_count}"
    return None


def batch_invariant_library(_library, **_facts) -> str | None:
    """vllm-ascend's AscendC library: its ``torch.ops`` namespace holds the mode's matmul and
    sum once the module is imported."""
    import torch

    from mcore_npu.ops.batch_invariant_rows import ATTRIBUTES, LIBRARY

    namespace = getattr(torch.ops, LIBRARY)
    missing = [name for name in ATTRIBUTES.values() if not _has_op(namespace, name)]
    return f"its torch.ops.{LIBRARY} has no {', '.join(missing)}" if missing else None


def _has_op(namespace, name: str) -> bool:
    """Whether the ``torch.ops`` ``namespace`` holds operator ``name`` (a lookup raises if not)."""
    try:
        getattr(namespace, name)
    except (AttributeError, RuntimeError):
        return False
    return True
