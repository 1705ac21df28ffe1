"""Segment boundaries of a packed (thd) batch for the GDN convolution and rule."""

from __future__ import annotations

import torch


def segment_bounds(packed_seq_params, seq: int, batch: int) -> torch.Tensor | None:
    """int64 ``[N + 1]`` starts of the packed segments over the ``seq`` tokens, or None (sbhd).

    From ``cu_seqlens_q_padded``, else ``cu_seqlens_q``; tokens after the last offset form one more
    segment; empty segments are dropped.

    Raises:
        ValueError: thd with batch > 1, or offsets that do not fit ``seq``.
    """
    if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
        return None
    if batch != 1:
        raise ValueError(
            f"packed_seq_params: thd expects the packed tokens as [t, 1, h], got batch {batch}; "
            "pack every sequence into one row"
        )
    cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    bounds = [int(x) for x in cu.tolist()]
    if bounds[0] != 0 or bounds[-1] > seq or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q: {bounds} does not cut the {seq} packed tokens "
            "(start at 0, non-decreasing, end <= tokens); pass the global offsets of this batch"
        )
    if bounds[-1] < seq:
        bounds.append(seq)
    kept = [b for i, b in enumerate(bounds) if i == 0 or b != bounds[i - 1]]  # no empty segment
    return torch.tensor(kept, dtype=torch.int64)
