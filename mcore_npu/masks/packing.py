"""Padded batch <-> packed (TND) batch, so padding costs no dense mask.

A padded ``[B, S]`` batch with a keep mask (True = real token) becomes one packed sequence of its
T real tokens plus segment boundaries (``Packed(BottomRightCausalMask())``). A right-padded batch
under causal attention needs no padding mask at all (``is_right_padded``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_npu.masks.seqlens import SeqLengths, SeqLengthsMemo


@dataclass(frozen=True, eq=False)
class PackedBatch:
    """Where the real tokens of a padded ``[B, S]`` batch sit once packed: ``indices`` ``[T]`` into
    the flattened ``[B * S]``, ``cu_seqlens`` int32 ``[B + 1]`` **with** the leading 0, ``lengths``
    host ends without it (all-padding rows have no segment there)."""

    indices: torch.Tensor
    cu_seqlens: torch.Tensor
    lengths: SeqLengths
    max_seqlen: int
    batch_size: int
    seq_len: int

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """``[B, S, ...]`` -> ``[T, ...]`` (the real tokens, row after row)."""
        return padded.flatten(0, 1).index_select(0, self.indices)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` -> ``[B, S, ...]`` with zeros at the padded positions."""
        out = packed.new_zeros(self.batch_size * self.seq_len, *packed.shape[1:])
        out.index_copy_(0, self.indices, packed)
        return out.unflatten(0, (self.batch_size, self.seq_len))

    def remember_in(self, memo: SeqLengthsMemo) -> None:
        """Tell a memo the host offsets of ``cu_seqlens`` (no attention layer syncs for them)."""
        memo.remember(self.cu_seqlens, self.lengths.q)

    def packed_seq_params(self):
        """Megatron ``PackedSeqParams(qkv_format="thd")`` for this batch (imports megatron)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def padding_to_packed(keep_mask: torch.Tensor) -> PackedBatch:
    """The real tokens of a padded batch (``keep_mask`` ``[B, S]``, True/1 = real token, padding
    anywhere) as a packed batch, one host sync: ``[[1, 1, 0], [1, 1, 1]]`` -> cu_seqlens 0, 2, 5."""
    if not isinstance(keep_mask, torch.Tensor) or keep_mask.dim() != 2:
        raise ValueError("keep_mask: expected a [B, S] tensor, True/1 = real token")
    keep = keep_mask.bool()
    row_lengths = keep.sum(1)  # [B]
    lengths = row_lengths.tolist()  # the one device-to-host sync
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=keep.device)
    torch.cumsum(row_lengths, 0, out=cu_seqlens[1:])
    return PackedBatch(
        indices=keep.flatten().nonzero().squeeze(1),
        cu_seqlens=cu_seqlens,
        lengths=SeqLengths.from_lengths(lengths).compact(),  # all-padding rows: no segment
        max_seqlen=max(lengths, default=0),
        batch_size=keep.shape[0],
        seq_len=keep.shape[1],
    )


def is_right_padded(keep_mask: torch.Tensor) -> bool:
    """True when every row's real tokens form a prefix (``1 1 1 0 0``), one host sync: then
    causal attention needs no padding mask."""
    keep = keep_mask.bool()
    return bool((keep[:, 1:] <= keep[:, :-1]).all())
