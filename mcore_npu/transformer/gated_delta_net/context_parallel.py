"""Gated DeltaNet under context parallelism, by all-to-all (sequence <-> heads).

The gated delta rule is a recurrence along the whole sequence, so a CP rank cannot run it on its
two chunks alone. Instead one all-to-all after ``in_proj`` trades the sequence split for a head
split: each CP rank then holds the WHOLE sequence for 1/CP of the heads, runs the causal conv,
the rule and the gated norm exactly as one process would, and a second all-to-all before
``out_proj`` brings the sequence split back::

    in_proj out  [s/CP, b, q|k|v|z|beta|alpha]   chunks r, 2CP-1-r (Megatron's zigzag)
      scatter_heads ->  [s, b, (q|k|v|z|beta|alpha)/CP]   natural order, heads of CP rank r
      conv1d / A_log / dt_bias: the rows of this rank's heads (GDNContextParallel.heads)
      ... rule, gated norm ...  [s, b, HV/CP * dv]
      gather_heads  ->  [s/CP, b, HV * dv]   chunks r, 2CP-1-r again -> out_proj

Head split: CP rank r takes key heads ``[r*H/CP, (r+1)*H/CP)`` and value heads
``[r*HV/CP, (r+1)*HV/CP)`` of its tensor-parallel rank. Value head h reads key head
``h // (HV/H)``, so a rank's value heads read exactly its own key heads: no key head travels
twice. Both counts (per TP rank) must divide by CP: ``linear_num_key_heads`` and
``linear_num_value_heads`` divisible by TP * CP.

Order: Megatron's load-balanced layout (rank r holds chunks r and 2CP-1-r of 2CP; packed thd:
of every sequence, each padded length divisible by 2CP) is undone after the first exchange and
redone by the second, with the permutations of :class:`..context_parallel.ulysses.TokenOrder`
(the all-to-all attention's). Both exchanges are autograd functions whose backward is the other
exchange. Parameter gradients: each CP rank gives its own channels of ``conv1d``, ``A_log`` and
``dt_bias`` (zeros elsewhere) and its own tokens' share of ``in_proj`` / ``out_proj``; Megatron's
gradient all-reduce over the data-and-context-parallel group adds them up.

The functions are pure (tensors and host ints in, tensors out); :class:`GDNContextParallel`
puts them behind the seam ``NPUGatedDeltaNet`` calls (``to_heads`` / ``heads`` /
``to_sequence``, the methods of the layer's ``NoContextParallel``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mcore_npu.masks.seqlens import SeqLengthsMemo
from mcore_npu.transformer.context_parallel.ulysses import HeadsToSeq, SeqToHeads, TokenOrder

__all__ = [
    "GDNContextParallel",
    "gather_heads",
    "packed_local_ends",
    "scatter_heads",
]


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

    Args:
        x: ``[s/CP, b, D]`` this rank's chunks r and 2CP-1-r (thd: ``[t/CP, 1, D]``, chunks r
            and 2CP-1-r of every packed sequence); D = ``sum(sections)``.
        sections: widths of the head-split sections of the last dim (e.g.
            :func:`in_proj_sections`), each divisible by CP; rank r gets slice r of each.
        group: the CP process group.
        thd_ends: packed only: the local padded cumulative ends without a leading 0, host ints
            (:func:`packed_local_ends`); None for sbhd.
        memo: the layer's ``SeqLengthsMemo``: a packed token order is built once per layout.

    Returns:
        ``[s, b, D/CP]`` (thd ``[t, 1, D/CP]``) in natural token order: the whole sequence,
        sections ``width/CP`` each, in the order given.
    """
    size = dist.get_world_size(group)
    _check_split(x, sections, size, thd_ends)
    order = TokenOrder(size, x.device, thd_ends, memo)
    parts = torch.split(x, list(sections), dim=-1)
    grouped = torch.cat([p.unflatten(-1, (size, -1)) for p in parts], dim=-1)  # [s_l, b, CP, D/CP]
    return SeqToHeads.apply(grouped, group, order).squeeze(-2)


def gather_heads(x: torch.Tensor, group, thd_ends=None, memo=None) -> torch.Tensor:
    """Head split -> sequence split, zigzag redone: the inverse of :func:`scatter_heads`.

    Args:
        x: ``[s, b, F]`` natural order, this rank's heads (e.g. ``HV/CP * V`` features);
            thd ``[t, 1, F]``.
        group, thd_ends: as in :func:`scatter_heads`.

    Returns:
        ``[s/CP, b, CP * F]``: chunks r and 2CP-1-r, the features of CP rank 0's heads first.
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
    """This CP rank's local padded cumulative ends (no leading 0) of a packed batch.

    Args:
        packed_seq_params: Megatron's ``PackedSeqParams`` with the GLOBAL offsets
            (``cu_seqlens_q_padded``, else ``cu_seqlens_q``), as ``get_thd_batch_on_this_cp_rank``
            leaves them; every padded length divides by ``2 * cp_size``.
        t_local: the tokens this rank holds; a padding tail after the last sequence becomes
            one more sequence of its own.
        memo: the spec's ``SeqLengthsMemo`` (one host sync per batch for all layers), or None.

    Returns:
        ``(e_1, ..., e_N)`` with ``e_N == t_local``: local sequence i spans ``[e_{i-1}, e_i)``.
    """
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
    """The all-to-all behind ``NPUGatedDeltaNet``'s context-parallel seam.

    Args:
        group: the CP process group (``pg_collection.cp``).
        memo: a ``SeqLengthsMemo`` for packed batches (share the spec's: one host sync of the
            offsets per batch for every layer); by default one of its own.
    """

    def __init__(self, group, memo: SeqLengthsMemo | None = None) -> None:
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.memo = SeqLengthsMemo() if memo is None else memo

    def to_heads(self, x: torch.Tensor, sections, packed_seq_params) -> torch.Tensor:
        """``[s/CP, b, C]`` (chunks r, 2CP-1-r; thd ``[t/CP, 1, C]``) -> ``[s, b, C/CP]`` in
        natural order, this rank's heads of every section (:func:`scatter_heads`).

        ``sections``: ``(heads, head_dim)`` of q, k, v, z, beta, alpha (TP-local heads)."""
        widths = []
        for heads, dim in sections:
            if heads % self.size:
                raise ValueError(
                    f"sections: {heads} heads per tensor-parallel rank do not divide by "
                    f"context_parallel_size={self.size}; fix: linear_num_key_heads and "
                    "linear_num_value_heads divisible by tensor x context parallel size"
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
