"""Token layout <-> chunk layout for the chunked gated delta rule.

Tokens ``[B, T, HV, D]`` become chunks ``[B, HV, NC, C, D]``: every segment (the whole sequence,
or each ``cu_seqlens`` segment with B == 1) is cut into chunks of C tokens, its last chunk padded
with zeros (g = 0, beta = 0 there, so padding changes nothing). ``ChunkPlan`` remembers which
chunk slots hold real tokens and where each segment's chunks start and end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkPlan:
    """Where T tokens sit in NC chunks of ``size`` slots: ``slots`` long ``[T]``, each token's
    ``chunk * size + position`` (None for a plain reshape); ``segments``: ``(first, end)`` chunk."""

    tokens: int
    size: int
    chunks: int
    segments: tuple[tuple[int, int], ...]
    slots: torch.Tensor | None

    @property
    def first_chunks(self) -> dict[int, int]:
        """chunk index -> segment index, for chunks that start a segment."""
        return {first: n for n, (first, end) in enumerate(self.segments) if end > first}

    @property
    def last_chunks(self) -> dict[int, int]:
        """chunk index -> segment index, for chunks that end a segment."""
        return {end - 1: n for n, (first, end) in enumerate(self.segments) if end > first}


def plan_chunks(tokens: int, bounds: list[int], size: int, device: torch.device) -> ChunkPlan:
    """Plan segments ``bounds`` (``[0, ..., T]``, ascending) into chunks of ``size`` tokens."""
    segments, slots, chunk = [], [], 0
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        count = -(-(end - start) // size)
        segments.append((chunk, chunk + count))
        slots.append(torch.arange(end - start) + chunk * size)
        chunk += count
    plain = len(segments) == 1 and tokens % size == 0
    index = None if plain else torch.cat(slots).to(device)
    return ChunkPlan(tokens, size, chunk, tuple(segments), index)


def to_chunks(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``[B, T, HV, *D]`` -> ``[B, HV, NC, C, *D]`` (zero padding), in x's dtype."""
    b, _, hv, *rest = x.shape
    if plan.slots is not None:
        padded = x.new_zeros(b, plan.chunks * plan.size, hv, *rest)
        x = padded.index_copy_(1, plan.slots, x)
    x = x.reshape(b, plan.chunks, plan.size, hv, *rest)
    return x.movedim(3, 1)


def from_chunks(y: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """``[B, HV, NC, C, *D]`` -> ``[B, T, HV, *D]`` (the real tokens only)."""
    y = y.movedim(1, 3)
    b, nc, c, hv, *rest = y.shape
    y = y.reshape(b, nc * c, hv, *rest)
    return y if plan.slots is None else y.index_select(1, plan.slots)
