"""Packed-sequence lengths: Megatron's ``cu_seqlens`` -> the operator's ``actual_seq_*len``.

``cu_seqlens`` is an int32 device tensor ``[S + 1]`` of cumulative offsets **starting with 0**;
``actual_seq_qlen`` a host list of cumulative **end** offsets **without** it::

    segment lengths 3, 0, 2   cu_seqlens tensor([0, 3, 3, 5])   actual_seq_qlen [3, 3, 5]

``actual_seq_lengths`` converts (one device-to-host sync); ``SeqLengthsMemo`` does it once per
tensor however many layers ask.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch


def actual_seq_lengths(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """``cu_seqlens`` ``[S + 1]`` (leading 0) -> ``tuple(cu_seqlens[1:])`` as host ints (one
    device-to-host copy)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
        raise TypeError(
            f"cu_seqlens: expected a 1-D integer tensor [S + 1], got {_describe(cu_seqlens)}; "
            "pass PackedSeqParams.cu_seqlens_q (or _kv / the _padded variants)"
        )
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens: dtype {cu_seqlens.dtype} is not an integer type; use int32")
    values = cu_seqlens.tolist()  # the one device-to-host sync
    if len(values) < 2 or values[0] != 0:
        raise ValueError(
            f"cu_seqlens: {values[:5]} does not start with 0; Megatron's cu_seqlens have a "
            "leading 0 (if these are already end offsets, pass them to the operator directly)"
        )
    return tuple(values[1:])


def _check_cp_divisible(ends: tuple[int, ...], cp_size: int) -> None:
    start = 0
    for i, end in enumerate(ends):
        if (end - start) % (2 * cp_size):
            raise ValueError(
                f"packed_seq_params.cu_seqlens_q_padded: packed sequence {i} has padded length "
                f"{end - start}, which does not divide by 2 * context_parallel_size = "
                f"{2 * cp_size}; fix: pad every sequence to a multiple of {2 * cp_size} and pass "
                "those offsets as cu_seqlens_q_padded (Megatron's get_thd_batch_on_this_cp_rank)"
            )
        start = end


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {list(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


@dataclass(frozen=True)
class SeqLengths:
    """Host-side segment boundaries of a packed batch: ``q``, ``kv`` are ``actual_seq_qlen`` /
    ``actual_seq_kvlen`` (end offsets, no leading 0)."""

    q: tuple[int, ...]
    kv: tuple[int, ...]

    @classmethod
    def from_lengths(cls, q_lengths, kv_lengths=None) -> SeqLengths:
        """From per-segment lengths, e.g. ``[3, 0, 2]`` -> ends ``(3, 3, 5)``."""
        q = tuple(_running_sum(q_lengths))
        kv = q if kv_lengths is None else tuple(_running_sum(kv_lengths))
        return cls(q, kv)

    @classmethod
    def with_padding(cls, real: SeqLengths, padded: SeqLengths) -> SeqLengths:
        """Slots of real tokens then padding (Megatron's ``_padded``): each slot becomes two
        segments, so real tokens never see the padding. Real 4, 9 + padded 5, 9 -> 4, 1, 9."""
        q_lengths, kv_lengths = [], []
        for (real_q, real_kv), (slot_q, slot_kv) in zip(real.segments(), padded.segments()):
            q_lengths += [real_q, slot_q - real_q]
            kv_lengths += [real_kv, slot_kv - real_kv]
        return cls.from_lengths(q_lengths, kv_lengths).compact()

    def segments(self) -> list[tuple[int, int]]:
        """``[(Sq_s, Skv_s), ...]``."""
        starts_q, starts_kv = (0, *self.q[:-1]), (0, *self.kv[:-1])
        return [(e - s, ek - sk) for s, e, sk, ek in zip(starts_q, self.q, starts_kv, self.kv)]

    def compact(self) -> SeqLengths:
        """Without segments empty on both sides (a leading one would read as a leading 0)."""
        kept = [(q, kv) for q, kv in self.segments() if q or kv]
        if not kept or len(kept) == len(self.q):
            return self
        return SeqLengths.from_lengths([q for q, _ in kept], [kv for _, kv in kept])


def _running_sum(lengths) -> list[int]:
    total, ends = 0, []
    for n in lengths:
        total += int(n)
        ends.append(total)
    return ends


def _version(tensor: torch.Tensor) -> tuple[int, int]:
    """Changes whenever the tensor's contents may have changed (in-place writes, new storage)."""
    return tensor._version, tensor.data_ptr()


class SeqLengthsMemo:
    """Per-step values derived from Megatron's batch tensors, once per tensor object, shared by
    every attention layer. Keyed by ``(id(), what)``, checked by weak reference and version counter
    (a reused id or an in-place refill is derived afresh); at most ``capacity`` entries (LRU)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.conversions = 0  # cu_seqlens device-to-host syncs
        self.expansions = 0  # [B,1,1,S] masks expanded
        self.keep_reads = 0  # [B, S] keep masks read (one sync each)
        self.plans_built = 0
        self._plans: OrderedDict[tuple, object] = OrderedDict()  # host key -> value, LRU
        # (id, what) -> (weak reference, (version, data pointer) when derived, value)
        self._entries: OrderedDict[tuple[int, object], tuple[weakref.ref, tuple, object]] = (
            OrderedDict()
        )

    def actual_seq_lengths(self, cu_seqlens: torch.Tensor) -> tuple[int, ...]:
        """Like :func:`actual_seq_lengths`, but at most once per tensor object."""
        ends = self._lookup(cu_seqlens, "ends")
        if ends is None:
            ends = actual_seq_lengths(cu_seqlens)
            self.conversions += 1
            self.remember(cu_seqlens, ends)
        return ends

    def context_parallel_ends(
        self, cu_seqlens_padded: torch.Tensor, cp_size: int
    ) -> tuple[int, ...]:
        """One CP rank's local padded ends ``cu_seqlens_padded[i + 1] // cp_size`` (no leading 0),
        once per tensor; ``ValueError`` when a padded length does not divide by ``2 * cp_size``."""
        ends = self._lookup(cu_seqlens_padded, ("cp_ends", cp_size))
        if ends is None:
            global_ends = self.actual_seq_lengths(cu_seqlens_padded)
            _check_cp_divisible(global_ends, cp_size)
            ends = tuple(end // cp_size for end in global_ends)
            self._store(cu_seqlens_padded, ("cp_ends", cp_size), ends)
        return ends

    def rows_expanded(self, mask: torch.Tensor, seq_q: int) -> torch.Tensor:
        """``[B, 1, 1, Skv]`` -> a contiguous bool ``[B, 1, Sq, Skv]`` (True = masked out), as
        Megatron's local attention broadcasts it; once per mask tensor and Sq."""
        expanded = self._lookup(mask, ("rows", seq_q))
        if expanded is None:
            batch, _, _, seq_kv = mask.shape
            expanded = mask.bool().expand(batch, 1, seq_q, seq_kv).contiguous()
            self.expansions += 1
            self._store(mask, ("rows", seq_q), expanded)
        return expanded

    def keep_prefix_form(self, keep: torch.Tensor) -> tuple[bool, bool]:
        """``(right_padded, no_empty_row)`` of a ``[B, S]`` keep mask (**True = real token**)."""
        form = self._lookup(keep, "keep_prefix")
        if form is None:
            real = keep.bool()
            checks = torch.stack([(real[:, 1:] <= real[:, :-1]).all(), real[:, :1].all()])
            form = tuple(bool(x) for x in checks.tolist())  # the one device-to-host sync
            self.keep_reads += 1
            self._store(keep, "keep_prefix", form)
        return form

    def plan(self, key: tuple, build):
        """``build()`` once per ``key`` (host values: a packed layout's ends, CP size and rank,
        device): index tensors every layer shares; the last ``capacity`` keys are kept."""
        if key in self._plans:
            self._plans.move_to_end(key)
            return self._plans[key]
        value = self._plans[key] = build()
        self.plans_built += 1
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return value

    def remember(self, cu_seqlens: torch.Tensor, ends: tuple[int, ...]) -> None:
        """Record host offsets already known (e.g. from ``padding_to_packed``): no sync later."""
        self._store(cu_seqlens, "ends", tuple(ends))

    def _lookup(self, tensor: torch.Tensor, what):
        key = (id(tensor), what)
        entry = self._entries.get(key)
        if entry is None or entry[0]() is not tensor or entry[1] != _version(tensor):
            return None
        self._entries.move_to_end(key)
        return entry[2]

    def _store(self, tensor: torch.Tensor, what, value) -> None:
        key = (id(tensor), what)
        self._entries[key] = (weakref.ref(tensor), _version(tensor), value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def __deepcopy__(self, memo) -> SeqLengthsMemo:
        # Megatron deep-copies specs; a copy starts empty rather than sharing ids.
        return SeqLengthsMemo(self.capacity)
