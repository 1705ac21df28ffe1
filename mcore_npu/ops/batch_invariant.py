"""Batch-invariant attention: the same sequence gives the same bits whatever else is in the batch.

Two layouts (N query heads, G key/value heads, D head dim; G divides N):

- ``"BSND"``: q ``[B, S, N, D]``, k/v ``[B, S, G, D]`` -> ``[B, S, N, D]``; each row attends to
  its own keys (causal: key j <= query i).
- ``"TND"``: q ``[T, N, D]``, k/v ``[T, G, D]`` -> ``[T, N, D]``; sequences packed one after the
  other, ``cu_seqlens`` ``[b + 1]`` int32 (leading 0), each attends only to itself.

On an NPU the kernel is ``flash_attn_npu``'s fixed-split ``flash_attn_func`` /
``flash_attn_varlen_func`` (what MindSpeed core_r0.16.0's ``--use-flash-attn-npu-batch-invariant``
calls, with the same keywords). Elsewhere it is :func:`fixed_block_attention`: every sequence on its
own, queries and keys in blocks of :data:`BLOCK` from position 0, every block's products of one
fixed shape, the blocks merged left to right by their running maxima. A row's result depends only
on its own sequence: padding, the batch size and the neighbours of a packed sequence never enter a
sum it reads. Dropout, sliding windows and masks other than causal / none are outside the mode
(``check_limits``). No torch_npu import at import (the registry loads the kernel).
"""

from __future__ import annotations

import torch

from mcore_npu.ops import registry

__all__ = [
    "BLOCK",
    "MAX_HEAD_DIM",
    "batch_invariant_attention",
    "check_limits",
    "fixed_block_attention",
    "missing_kernel",
]

OP = "batch_invariant_attention"
BLOCK = 64
"""Query and key block of the reference: every product it computes is ``[BLOCK, D] x [D, BLOCK]``
or ``[BLOCK, BLOCK] x [BLOCK, D]``, whatever the sequence length."""
MAX_HEAD_DIM = 256
"""The largest head dim the mode takes (flash_attn_npu's limit, as MindSpeed's)."""
PACKAGE = "flash-attention-npu"
"""What to install for ``flash_attn_npu`` (MindSpeed's error names the same package)."""


def check_limits(
    *,
    context_parallel_size: int = 1,
    dropout: float = 0.0,
    head_dim: int = 0,
    mask_kind: str = "causal",
    window: tuple | None = None,
) -> None:
    """The mode's limits, each refused in one line (``ValueError``), as Megatron's own checks.

    ``mask_kind``: Megatron's ``AttnMaskType`` name; causal (``causal``, ``padding_causal``:
    verl's right padding) and ``no_mask`` pass.
    """
    problems = []
    if context_parallel_size > 1:
        problems.append(f"context_parallel_size={context_parallel_size}: use 1")
    if dropout:
        problems.append(f"attention_dropout={dropout}: use 0.0")
    if head_dim > MAX_HEAD_DIM:
        problems.append(f"head dim {head_dim} > {MAX_HEAD_DIM}: use a model of head dim <= 256")
    if window is not None:
        problems.append(f"window_size={tuple(window)} (sliding window): use full causal attention")
    if mask_kind not in ("causal", "padding_causal", "no_mask"):
        problems.append(f"attn_mask_type={mask_kind}: use causal or no_mask")
    if problems:
        raise ValueError(f"batch-invariant mode does not support {problems[0]}")


def missing_kernel(on_npu: bool) -> str | None:
    """One line naming the package to install when ``on_npu`` (the caller's answer: this
    machine's accelerator is an NPU) and the batch-invariant attention kernel cannot run; None
    when it can, or off an NPU (the reference runs there)."""
    if not on_npu:
        return None
    kernel = registry.operator(OP).kernels[0]
    reason = registry.why_not(kernel)
    if reason is None:
        return None
    return (
        f"batch-invariant mode on an NPU needs {kernel.module} ({reason}); "
        f"install {PACKAGE} (pip install flash-attention-npu), or turn the mode off"
    )


def batch_invariant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str,
    causal: bool,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """Batch-invariant attention of ``layout`` (``"BSND"`` or ``"TND"``, module docstring).

    Args:
        cu_seqlens: TND only: ``[b + 1]`` int32, leading 0, ends at T.
        max_seqlen: TND only: the longest sequence (the kernel's ``max_seqlen_q/k``).
        kernel: ``"auto"`` (flash_attn_npu on NPU tensors, else the reference),
            ``"flash_attn_npu"`` or ``"reference"``.

    Returns:
        the layout of ``q`` (``[B, S, N, D]`` / ``[T, N, D]``), ``q``'s dtype.
    """
    validate_batch_invariant_attention(q, k, v, layout=layout, cu_seqlens=cu_seqlens)
    choice = registry.resolve(OP, kernel, q.device)
    if choice.kernel == registry.REFERENCE:
        return fixed_block_attention(
            q, k, v, layout=layout, causal=causal, scale=scale, cu_seqlens=cu_seqlens
        )
    q, k, v = (t.contiguous() for t in (q, k, v))  # the kernels take dense layouts
    common = dict(
        dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(-1, -1),
        alibi_slopes=None, deterministic=False, return_attn_probs=False,
    )  # fmt: skip
    if layout == "BSND":
        return registry.ascend(OP, choice.kernel, "flash_attn_func")(q, k, v, **common)
    varlen = registry.ascend(OP, choice.kernel, "flash_attn_varlen_func")
    cu = cu_seqlens.to(torch.int32)
    return varlen(q, k, v, cu, cu, max_seqlen, max_seqlen, **common, block_table=None)


def validate_batch_invariant_attention(q, k, v, *, layout: str, cu_seqlens=None, **_) -> None:
    """Shapes of one call; ValueError listing them."""
    dims = {"BSND": 4, "TND": 3}
    problem = None
    if layout not in dims:
        problem = f"layout {layout!r} is not BSND or TND"
    elif not q.dim() == k.dim() == v.dim() == dims[layout]:
        problem = f"{layout} takes {dims[layout]}-D q/k/v"
    elif k.shape != v.shape or q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        problem = "k and v must share one shape, and q its leading dims and head dim"
    elif q.shape[-2] % k.shape[-2]:
        problem = "the query heads must be a multiple of the key/value heads"
    elif layout == "TND" and (cu_seqlens is None or int(cu_seqlens[-1]) != q.shape[0]):
        problem = "TND needs cu_seqlens (leading 0) ending at T"
    if problem:
        raise ValueError(
            f"batch_invariant_attention: {problem}\n"
            f"  q {tuple(q.shape)} {q.dtype}\n  k {tuple(k.shape)}\n  v {tuple(v.shape)}"
        )


def fixed_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str,
    causal: bool,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: each sequence through :func:`_sequence` (fp32 inside), one at a time."""
    if layout == "BSND":
        rows = [_sequence(q[b], k[b], v[b], causal, scale) for b in range(q.shape[0])]
        return torch.stack(rows).to(q.dtype)
    ends = cu_seqlens.tolist()
    parts = [
        _sequence(q[s:e], k[s:e], v[s:e], causal, scale)
        for s, e in zip(ends[:-1], ends[1:], strict=True)
    ]
    return torch.cat(parts).to(q.dtype)


def _sequence(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """One sequence: q ``[S, N, D]``, k/v ``[S, G, D]`` -> ``[S, N, D]`` fp32.

    Both sides are zero-padded to whole blocks; a padded key is masked out (its weight is an
    exact 0). Key block j is merged into the running (max, sum, output) of every query block in
    order j = 0, 1, ... (under causal, of query blocks j and later: the earlier ones see none of
    it); a block a query cannot see adds exact zeros and leaves its max alone.
    """
    seq, heads, dim = q.shape
    groups = k.shape[1]
    blocks = -(-seq // BLOCK)
    padded = blocks * BLOCK
    # [S, N, D] -> [G, N/G, blocks, BLOCK, D]: the query heads of one key head side by side
    qb = (
        _pad(q.float(), padded)
        .permute(1, 0, 2)
        .reshape(groups, heads // groups, blocks, BLOCK, dim)
    )
    kb = _pad(k.float(), padded).permute(1, 0, 2).reshape(groups, 1, blocks, BLOCK, dim)
    vb = _pad(v.float(), padded).permute(1, 0, 2).reshape(groups, 1, blocks, BLOCK, dim)
    rows = torch.arange(padded, device=q.device).view(blocks, BLOCK, 1)
    shape = (groups, heads // groups, blocks, BLOCK)
    best = torch.full((*shape, 1), float("-inf"), device=q.device)
    total = torch.zeros((*shape, 1), device=q.device)
    out = torch.zeros((*shape, dim), device=q.device)
    for j in range(blocks):
        first = j if causal else 0  # query blocks before j see none of key block j: skipped
        keys = torch.arange(j * BLOCK, (j + 1) * BLOCK, device=q.device).view(1, BLOCK)
        hidden = keys >= seq  # [1, BLOCK]: padding keys
        if causal:
            hidden = hidden | (keys > rows[first:])  # [blocks - j, BLOCK, BLOCK]
        # [G, N/G, b, BLOCK, D] x [G, 1, 1, D, BLOCK] -> [G, N/G, b, BLOCK, BLOCK]
        scores = torch.matmul(qb[:, :, first:], kb[:, :, j : j + 1].transpose(-1, -2)) * scale
        scores = scores.masked_fill(hidden, float("-inf"))
        old = best[:, :, first:]
        new_best = torch.maximum(old, scores.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(new_best), torch.zeros_like(new_best), new_best)
        weights = torch.exp(scores - safe)  # masked: exp(-inf) = 0 exactly
        keep = torch.exp(old - safe)  # 1 exactly where the max did not move
        summed = total[:, :, first:] * keep + weights.sum(-1, keepdim=True)
        merged = out[:, :, first:] * keep + torch.matmul(weights, vb[:, :, j : j + 1])
        # the query blocks before ``first`` unchanged (no in-place writes: autograd records all)
        total = torch.cat([total[:, :, :first], summed], dim=2)
        out = torch.cat([out[:, :, :first], merged], dim=2)
        best = torch.cat([best[:, :, :first], new_best], dim=2)
    out = out / total  # every real query sees at least key 0
    # [G, N/G, blocks, BLOCK, D] -> [S, N, D]
    return out.reshape(heads, padded, dim).permute(1, 0, 2)[:seq]


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """``[S, H, D]`` -> ``[length, H, D]`` with zero rows appended."""
    return torch.nn.functional.pad(t, (0, 0, 0, 0, 0, length - t.shape[0]))
