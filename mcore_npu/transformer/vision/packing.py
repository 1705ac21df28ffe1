"""verl's thd batch for a model that packs its own tokens: where each kept token goes.

verl 0.9.1's ``model_forward_gen(True)`` hands a vision-language model its ``input_ids`` still
padded ``[B, S]``, the bool ``attention_mask`` ``[B, S]`` (**True = token**, rows left- or
right-padded) and ``packed_seq_params`` over the valid tokens. :class:`PackPlan` puts row ``i``'s
tokens, in order, at ``cu_seqlens_q_padded[i]`` (``cu_seqlens_q`` without padding), as verl's
``preprocess_packed_seqs`` does, so verl's ``postprocess_packed_seqs`` unpacks the logits. Under
context parallelism a rank keeps chunks ``r`` and ``2·CP-1-r`` of every sequence (verl's split);
the positions stay the whole batch's, from which the attention picks this rank's."""

from __future__ import annotations

import torch

from mcore_npu.transformer.rope import packed_positions


def packs_itself(packed_seq_params, attention_mask) -> bool:
    """Whether this is verl's thd call: a ``[B, S]`` mask next to a thd description."""
    thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
    return thd and attention_mask is not None and attention_mask.dim() == 2


class PackPlan:
    """The packed slot ``[B, S]`` of every token (-1 for padding), the packed length ``T`` and,
    under CP, this rank's slots (``[T/CP]``, verl's order)."""

    def __init__(self, attention_mask: torch.Tensor, packed_seq_params, cp_size=1, cp_rank=0):
        params = packed_seq_params
        padded = params.cu_seqlens_q_padded
        starts = (padded if padded is not None else params.cu_seqlens_q).tolist()
        keep = attention_mask.bool()
        self.rows, self.cols = keep.nonzero(as_tuple=True)  # row-major: each row in order
        counts = keep.sum(-1).tolist()
        first = [start for start, n in zip(starts, counts) for _ in range(n)]
        within = [i for n in counts for i in range(n)]
        device = attention_mask.device
        self.slots = torch.tensor(first, device=device) + torch.tensor(within, device=device)
        self.total = int(starts[-1])
        self.slot_of = torch.full(keep.shape, -1, dtype=torch.long, device=device)
        self.slot_of[self.rows, self.cols] = self.slots
        local = packed_positions(starts[1:], cp_size, cp_rank, exact=True)
        self.local = torch.tensor(local, dtype=torch.long, device=device)
        self.local_of = torch.full((self.total,), -1, dtype=torch.long, device=device)
        self.local_of[self.local] = torch.arange(len(local), device=device)

    def ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` -> ``[1, T/CP]``: this rank's slots (padding slots 0)."""
        packed = input_ids.new_zeros(1, self.total)
        packed[0, self.slots] = input_ids[self.rows, self.cols]
        return packed[:, self.local]

    def positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """``[3, B, S]`` -> ``[3, 1, T]``, every rank the whole batch's (padding slots 0)."""
        packed = position_ids.new_zeros(3, 1, self.total)
        packed[:, 0, self.slots] = position_ids[:, self.rows, self.cols]
        return packed

    def where(self, b: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded ``(b, s)`` token indices -> this rank's hidden rows ``(t, 0)`` (-1: a token
        another CP rank holds)."""
        return self.local_of[self.slot_of[b, s]], torch.zeros_like(s)
