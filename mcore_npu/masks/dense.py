"""Dense ``[B, 1, S, S]`` masks, for callers that must have one (verl's bshd path); prefer a
mask description (``TopLeftCausalMask``, ``Packed``), which costs nothing per step."""

from __future__ import annotations

import torch


def build_npu_attention_mask(keep_mask: torch.Tensor) -> torch.Tensor:
    """Padding + causal mask in the operator's polarity, filled in place.

    ``keep_mask`` ``[B, S]`` bool or integer (non-zero = real token) -> ``[B, 1, S, S]`` bool,
    **True = masked out**: ``out[b, 0, i, j] = not (j <= i and keep[b, i] and keep[b, j])``.
    The values of verl's ``_build_npu_attn_mask`` (its diagonal gives the keep mask back), at a
    peak of the output plus O(B*S).
    """
    if not isinstance(keep_mask, torch.Tensor) or keep_mask.dim() != 2:
        raise ValueError(
            f"keep_mask: expected a [B, S] tensor (True/1 = real token), got "
            f"{list(keep_mask.shape) if isinstance(keep_mask, torch.Tensor) else type(keep_mask)}"
        )
    if not _is_bool_or_integer(keep_mask.dtype):
        raise TypeError(
            f"keep_mask: dtype {keep_mask.dtype} is not supported; pass the [B, S] keep mask as "
            f"bool (True = real token) or an integer dtype (1 = real token, 0 = padding), e.g. "
            f"verl's attention_mask as it comes, or keep_mask.bool()"
        )
    batch, seq = keep_mask.shape
    out = torch.empty(batch, 1, seq, seq, dtype=torch.bool, device=keep_mask.device)
    if batch == 0 or seq == 0:
        return out
    index = torch.arange(seq, device=keep_mask.device)
    torch.gt(index.unsqueeze(0), index.unsqueeze(1), out=out[0, 0])  # [i, j] = j > i (future key)
    out[1:].copy_(out[:1])  # broadcast copy into the other rows: no temporary
    padded = torch.logical_not(keep_mask)  # [B, S], True = padding
    out.logical_or_(padded.view(batch, 1, seq, 1))  # padded query rows
    out.logical_or_(padded.view(batch, 1, 1, seq))  # padded key columns
    return out


def _is_bool_or_integer(dtype: torch.dtype) -> bool:
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return False
    try:
        torch.iinfo(dtype)
    except TypeError:  # quantized and other exotic dtypes
        return False
    return True
