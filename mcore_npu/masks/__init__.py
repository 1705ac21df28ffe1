"""Masks for ``npu_fusion_attention`` that cost nothing per step (docs/masks.md).

Polarity everywhere: a **mask** is True where the score is **masked out** (the operator's and
Megatron's convention, the opposite of SDPA's boolean ``attn_mask``).
"""

from mcore_npu.masks.compressed import (
    COMPRESSED_MASKS,
    CompressedMaskCache,
    compressed_causal_mask,
    compressed_prefix_mask,
    normalize_device,
)
from mcore_npu.masks.dense import build_npu_attention_mask
from mcore_npu.masks.descriptions import (
    BottomRightCausalMask,
    ExplicitMask,
    FullAttention,
    MaskDescription,
    OperatorMaskArgs,
    Packed,
    SlidingWindow,
    TopLeftCausalMask,
    check_explicit_mask,
    describe_mask,
    draw,
)
from mcore_npu.masks.packing import PackedBatch, is_right_padded, padding_to_packed
from mcore_npu.masks.seqlens import SeqLengths, SeqLengthsMemo, actual_seq_lengths

__all__ = [
    "COMPRESSED_MASKS",
    "BottomRightCausalMask",
    "CompressedMaskCache",
    "ExplicitMask",
    "FullAttention",
    "MaskDescription",
    "OperatorMaskArgs",
    "Packed",
    "PackedBatch",
    "SeqLengths",
    "SeqLengthsMemo",
    "SlidingWindow",
    "TopLeftCausalMask",
    "actual_seq_lengths",
    "build_npu_attention_mask",
    "check_explicit_mask",
    "compressed_causal_mask",
    "compressed_prefix_mask",
    "describe_mask",
    "draw",
    "is_right_padded",
    "normalize_device",
    "padding_to_packed",
]
