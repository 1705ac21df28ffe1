"""verl's ``[B, S]`` key-padding mask in Megatron's attention-mask slot (docs/masks.md).

**Polarity: True = real token** (verl's, the opposite of every other mask in this package).
Right-padded under causal attention it needs no mask at all: it becomes the layer's own causal
(or causal window) description. Left or interior padding and non-causal layers are refused; a
``[S, S]`` mask stays a dense one (True = masked out). When ``B == S`` the rows decide.
"""

from __future__ import annotations

import torch

from mcore_npu.masks.seqlens import SeqLengthsMemo

_CAUSAL = frozenset({"causal", "padding_causal", "causal_bottom_right"})


def is_key_padding(
    mask, *, batch: int | None, seq_q: int, seq_kv: int, memo: SeqLengthsMemo
) -> bool:
    """Whether ``mask`` is verl's ``[B, Skv]`` key-padding mask (True = real token)."""
    if batch is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    if mask.dtype not in (torch.bool, torch.uint8) or tuple(mask.shape) != (batch, seq_kv):
        return False
    if (seq_q, seq_kv) != tuple(mask.shape):
        return True  # only the key-padding reading fits the shape
    right_padded, no_empty_row = memo.keep_prefix_form(mask)
    return right_padded and no_empty_row


def check_key_padding(
    mask: torch.Tensor, kind: str, *, seq_q: int, seq_kv: int, memo: SeqLengthsMemo
) -> None:
    """Refuse, with the fix, a key-padding mask the causal description would not honour: on a
    layer that is not causal, with Sq != Skv, or with padding not at the right of every row."""
    shape = list(mask.shape)
    if kind not in _CAUSAL:
        raise ValueError(
            f"attention_mask: a {shape} key-padding mask (True = real token, verl's bshd "
            f"forward) on an attn_mask_type={kind} layer: its queries would attend the padded "
            "keys; pack the batch instead (mcore_npu.masks.padding_to_packed, verl: "
            "use_remove_padding=True)"
        )
    if seq_q != seq_kv:
        raise ValueError(
            f"attention_mask: a {shape} key-padding mask with {seq_q} queries and {seq_kv} keys;"
            " key padding is read for self-attention over the padded batch only (Sq == Skv)"
        )
    if not memo.keep_prefix_form(mask)[0]:
        raise ValueError(
            f"attention_mask: the {shape} key-padding mask (True = real token) has padding "
            "before real tokens (left or interior padding); right-pad every row, as verl does, "
            "or pack the batch (mcore_npu.masks.padding_to_packed)"
        )


__all__ = ["check_key_padding", "is_key_padding"]
