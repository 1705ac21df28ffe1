"""Gated DeltaNet under context parallelism, by all-to-all (sequence <-> heads).

The rule is a recurrence along the whole sequence, so :func:`scatter_heads` after ``in_proj`` trades
the sequence split (chunks r, 2CP-1-r) for a head split (the WHOLE sequence, 1/CP of the heads,
natural order) and :func:`gather_heads` before ``out_proj`` brings it back. CP rank r takes key
heads ``[r*H/CP, (r+1)*H/CP)`` and the value heads that read them. :class:`GDNContextParallel` is
the layer's seam. See docs/gdn_cp.md."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mcore_npu.masks.seqlens import SeqLengthsMemo
from mcore_npu.transformer.context_parallel.ulysses import HeadsToSeq, SeqToHeads, TokenOrder

__all__ = ["GDNContextParallel", "gather_heads", "packed_local_ends", "scatter_heads"]


def _check_split(x: torch.Tensor, sections: Sequence[int], size: int, thd_ends) -> None:
    if x.dim() != 3:
        raise ValueError(
            f"hidden: expected [s/CP, b, features] (thd: [t/CP, 1, features]), got shape "
            f"{list(x.shape)}"
        )
    if sum(sections) != x.shape[-1] or any(width % size for width in sections):
        raise ValueError(
            f"sections: {list(sections)} must add up to the last dim {x.shape[-1]} and each "
            f"divide by context_parallel_size={size}; pass the widths of this TP rank's in_proj sections"
        )
    if thd_ends is None and x.shape[0] % 2:
        raise ValueError(
            f"hidden: {x.shape[0]} local tokens, not the two equal chunks of Megatron's CP "
            f"layout; fix: a sequence length divisible by 2 * context_parallel_size = {2 * size}"
        )
    if thd_ends is not None and (not thd_ends or tuple(thd_ends)[-1] != x.shape[0]):
        raise ValueError(
            f"thd_ends: expected the local padded cumulative ends without a leading 0, ending "
            f"at the local token count {x.shape[0]}; got {thd_ends!r} (see packed_local_ends)"
        )


def scatter_heads(x: torch.Tensor, sections: Sequence[int], group, thd_ends=None, memo=None):
    """Sequence split -> head split, zigzag undone (autograd: the backward is the inverse).

    ``x``: ``[s/CP, b, D]`` (thd ``[t/CP, 1, D]``), D = ``sum(sections)``, each section divisible by
    CP (rank r gets slice r of each); ``thd_ends``: packed only, the local padded cumulative ends
    (:func:`packed_local_ends`). Returns ``[s, b, D/CP]`` (thd ``[t, 1, D/CP]``) in natural order.
    """
    size = dist.get_world_size(group)
    _check_split(x, sections, size, thd_ends)
    order = TokenOrder(size, x.device, thd_ends, memo)
    parts = torch.split(x, list(sections), dim=-1)
    grouped = torch.cat([p.unflatten(-1, (size, -1)) for p in parts], dim=-1)  # [s_l, b, CP, D/CP]
    return SeqToHeads.apply(grouped, group, order).squeeze(-2)


def gather_heads(x: torch.Tensor, group, thd_ends=None, memo=None) -> torch.Tensor:
    """Head split -> sequence split, zigzag redone: the inverse of :func:`scatter_heads`.
    ``[s, b, F]`` (thd ``[t, 1, F]``) -> ``[s/CP, b, CP * F]``, CP rank 0's heads' features first.
    """
    size = dist.get_world_size(group)
    if x.dim() != 3 or x.shape[0] % size:
        raise ValueError(
            f"x: expected [s, b, features] with s divisible by context_parallel_size={size}, "
            f"got shape {list(x.shape)}"
        )
    order = TokenOrder(size, x.device, thd_ends, memo)
    return HeadsToSeq.apply(x.unsqueeze(-2), group, order).flatten(-2)


def packed_local_ends(
    packed_seq_params, cp_size: int, t_local: int, memo: SeqLengthsMemo | None = None
) -> tuple[int, ...]:
    """This CP rank's local padded cumulative ends ``(e_1, ..., e_N)``, ``e_N == t_local``, from the
    GLOBAL offsets in ``packed_seq_params`` (``cu_seqlens_q_padded``, else ``cu_seqlens_q``); a
    padding tail becomes one more sequence of its own."""
    padded = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    padded = packed_seq_params.cu_seqlens_q if padded is None else padded
    memo = SeqLengthsMemo() if memo is None else memo  # an empty memo is falsy: no `or`
    ends = memo.context_parallel_ends(padded, cp_size)
    if ends and ends[-1] > t_local:
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q_padded: ends at {ends[-1] * cp_size} tokens, but "
            f"this CP rank holds {t_local} (x {cp_size} ranks); pass the GLOBAL padded offsets "
            "of the batch that get_thd_batch_on_this_cp_rank split"
        )
    if not ends or ends[-1] < t_local:
        ends = (*ends, t_local)
    return ends


class GDNContextParallel:
    """The all-to-all behind ``NPUGatedDeltaNet``'s context-parallel seam; ``memo`` (share the
    spec's) converts packed offsets once per batch."""

    def __init__(self, group, memo: SeqLengthsMemo | None = None) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.memo = SeqLengthsMemo() if memo is None else memo

    def to_heads(self, x: torch.Tensor, sections, packed_seq_params) -> torch.Tensor:
        """``[s/CP, b, C]`` (chunks r, 2CP-1-r; thd ``[t/CP, 1, C]``) -> ``[s, b, C/CP]`` in natural
        order; ``sections``: ``(heads, head_dim)`` of q, k, v, z, beta, alpha (TP-local heads)."""
        widths = []
        for heads, dim in sections:
            if heads % self.size:
                raise ValueError(
                    f"sections: {heads} heads per tensor-parallel rank do not divide by "
                    f"context_parallel_size={self.size}; fix: the layer's heads and groups "
                    "divisible by tensor x context parallel size (GDN: linear_num_key_heads, "
                    "linear_num_value_heads; Mamba: mamba_num_heads, mamba_num_groups)"
                )
            widths.append(heads * dim)
        ends = self._ends(packed_seq_params, x.shape[0])
        return scatter_heads(x, widths, self.group, ends, self.memo)

    def heads(self, count: int) -> slice:
        """This CP rank's share of ``count`` TP-local heads: ``[r*count/CP, (r+1)*count/CP)``."""
        share = count // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def to_sequence(self, x: torch.Tensor, packed_seq_params) -> torch.Tensor:
        """``[s, b, Hv/CP * V]`` natural order -> ``[s/CP, b, Hv * V]`` (chunks r, 2CP-1-r)."""
        t_local = x.shape[0] // self.size
        return gather_heads(x, self.group, self._ends(packed_seq_params, t_local), self.memo)

    def _ends(self, packed_seq_params, t_local: int):
        """The local padded ends of a packed (thd) batch, None for sbhd."""
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
            return None
        return packed_local_ends(packed_seq_params, self.size, t_local, self.memo)
