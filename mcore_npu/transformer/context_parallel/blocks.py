"""The ring's block schedule, shared by sbhd and packed thd, and how one block becomes one call.

Rank r holds query parts ``EARLY`` (chunk r) and ``LATE`` (chunk 2·CP-1-r), ``BOTH`` together; at
ring step i it holds the K/V of rank ``src = (r - i) mod CP``. Without a window a step is one block:
step 0 ``BOTH -> BOTH`` causal; ``src < r``: ``BOTH -> src's EARLY`` full (sbhd: one block per query
part); ``src > r``: ``LATE -> BOTH`` full. With a causal window ``(left, 0)`` (sbhd only) a step is
up to four chunk-pair blocks, each a band shifted by the chunks' distance (sparse mode 4), skipped
or full where the band misses or covers it. A *layout* (:class:`DenseLayout`, :class:`PackedLayout`)
turns parts into rows and blocks into mask keywords."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_npu.masks import compressed_causal_mask
from mcore_npu.transformer.context_parallel import chunks

EARLY, LATE, BOTH = "early", "late", "both"
CAUSAL, FULL = ("causal",), ("full",)


@dataclass(frozen=True)
class Block:
    """One operator call: query part ``rows``, key part ``keys``, ``mask`` = CAUSAL, FULL or
    ``("band", pre, next)`` (sparse mode 4, bottom-right origin)."""

    rows: str
    keys: str
    mask: tuple


def schedule(
    rank: int,
    size: int,
    step: int,
    *,
    left: int | None = None,
    chunk: int = 0,
    split_rows: bool = False,
):
    """The blocks of ring step ``step`` on CP rank ``rank``.

    Args:
        left: the causal window's left width, or None for plain causal attention.
        chunk: c, the tokens of one chunk (needed with a window only).
        split_rows: a ``src < r`` step as two blocks, one per query part (for layouts whose parts
            are views).
    """
    src = (rank - step) % size
    if left is None:
        if step == 0:
            return [Block(BOTH, BOTH, CAUSAL)]
        if src < rank and split_rows:
            return [Block(EARLY, EARLY, FULL), Block(LATE, EARLY, FULL)]
        if src < rank:
            return [Block(BOTH, EARLY, FULL)]
        return [Block(LATE, BOTH, FULL)]
    found = []
    for q_part, a in zip((EARLY, LATE), chunks.chunk_ids(rank, size)):
        for k_part, b in zip((EARLY, LATE), chunks.chunk_ids(src, size)):
            mask = _window_mask(a - b, left, chunk)
            if mask is not None:
                found.append(Block(q_part, k_part, mask))
    return found


def _window_mask(chunks_apart: int, left: int, chunk: int) -> tuple | None:
    """Mask of query chunk a against key chunk ``a - chunks_apart`` under the causal window
    ``left``; None when the band keeps nothing of the block."""
    if chunks_apart < 0:
        return None  # keys after every query
    delta = chunks_apart * chunk
    if chunks_apart == 0:
        return ("band", left, 0)
    if delta - left > chunk - 1:
        return None  # the nearest pair is further back than the window reaches
    if delta - left <= -(chunk - 1):
        return FULL  # the furthest pair is still inside the window
    return ("band", left - delta, delta)  # |pre| < c <= next where pre < 0: legal in mode 4


class DenseLayout:
    """sbhd: local q ``[2c, b, np*hn]``, k/v ``[2c, b, ng*hn]`` (SBH); statistics
    ``[rows, b, np, 1]`` float32."""

    input_layout = "SBH"
    split_rows = True  # parts are slices: a block per query part costs no copy

    def __init__(self, tokens: int, heads: int, device) -> None:
        self.chunk, self.heads, self.device = tokens // 2, heads, device

    def rows(self, part: str) -> slice:
        c = self.chunk
        return {BOTH: slice(0, 2 * c), EARLY: slice(0, c), LATE: slice(c, 2 * c)}[part]

    def mask_kwargs(self, block: Block) -> dict:
        if block.mask == FULL:
            return {"sparse_mode": 0}
        kwargs = {"atten_mask": compressed_causal_mask(self.device)}
        if block.mask == CAUSAL:
            return {**kwargs, "sparse_mode": 2}
        _, pre, nxt = block.mask
        return {**kwargs, "sparse_mode": 4, "pre_tockens": pre, "next_tockens": nxt}

    def out_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The operator's ``[r, b, np*hn]`` -> float32 ``[r, b, np, hn]``."""
        return out.float().unflatten(-1, (self.heads, -1))

    def stats_rows(self, stat: torch.Tensor, part: str) -> torch.Tensor:
        """``[B, N, r, 8]`` -> ``[r, B, N, 1]`` (a copy: the 8-wide output is freed)."""
        return stat[..., 0].permute(2, 0, 1).unsqueeze(-1).contiguous()

    def stats_op(self, stat: torch.Tensor, part: str) -> torch.Tensor:
        """``[r, B, N, 1]`` -> ``[B, N, r, 8]``, the operator's layout."""
        return stat[..., 0].permute(1, 2, 0).unsqueeze(-1).expand(-1, -1, -1, 8).contiguous()

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Merged ``[2c, b, np, hn]`` -> the operator's ``[2c, b, np*hn]``."""
        return out.flatten(2)


class PackedLayout:
    """thd: local q ``[t, np, hn]``, k/v ``[t, ng, hn]`` (TND); sequence i spans
    ``[ends[i-1], ends[i])`` (chunk r, then chunk 2CP-1-r). Statistics ``[rows, np, 1]`` float32 in
    token order; the operator's are N-major per segment, converted with index tensors built once per
    layout."""

    input_layout = "TND"
    split_rows = False  # parts are index tensors: a block per part would gather copies

    def __init__(self, ends: tuple[int, ...], heads: int, device, memo=None) -> None:
        self.ends, self.heads, self.device = tuple(ends), heads, device
        key = ("cp_ring", self.ends, heads, torch.device(device))
        self.plan = chunks.planned(memo, key, lambda: _packed_plan(*key[1:]))

    def rows(self, part: str):
        return slice(0, self.ends[-1]) if part == BOTH else self.plan[part]

    def lengths(self, part: str) -> list[int]:
        """The part's ``actual_seq_*len``: cumulative ends, no leading 0, host ints."""
        return list(self.ends if part == BOTH else self.plan["half_ends"])

    def mask_kwargs(self, block: Block) -> dict:
        kwargs = {
            "actual_seq_qlen": self.lengths(block.rows),
            "actual_seq_kvlen": self.lengths(block.keys),
        }
        if block.mask == FULL:
            return {**kwargs, "sparse_mode": 0}
        if block.mask == CAUSAL:  # square per sequence: bottom-right causal = causal
            return {**kwargs, "atten_mask": compressed_causal_mask(self.device), "sparse_mode": 3}
        raise NotImplementedError(f"packed ring blocks take no band mask, got {block.mask}")

    def out_rows(self, out: torch.Tensor) -> torch.Tensor:
        return out.float()  # [r, np, hn]

    def stats_rows(self, stat: torch.Tensor, part: str) -> torch.Tensor:
        """``[r, N, 8]`` (N-major per segment) -> ``[r, N, 1]`` in token order."""
        flat = stat.reshape(-1, 8)[:, 0]
        return flat[self.plan["stats_" + _segmentation(part)]].unsqueeze(-1)

    def stats_op(self, stat: torch.Tensor, part: str) -> torch.Tensor:
        """``[r, N, 1]`` in token order -> ``[r, N, 8]`` N-major per segment (the operator's)."""
        index = self.plan["stats_" + _segmentation(part)]
        flat = stat.new_empty(index.numel())
        flat[index.reshape(-1)] = stat.reshape(-1)
        return flat.unsqueeze(-1).expand(-1, 8).reshape(*stat.shape[:-1], 8)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        return out  # [t, np, hn]


def _segmentation(part: str) -> str:
    return "whole" if part == BOTH else "half"


def _packed_plan(ends: tuple[int, ...], heads: int, device: torch.device) -> dict:
    """Index tensors of one packed layout: ``early`` / ``late`` rows, ``half_ends``, and
    ``stats_whole`` / ``stats_half`` (``[r, N]`` positions in statistics filled N-major per
    segment)."""
    lengths = torch.tensor((0, *ends)).diff()
    if bool((lengths % 2).any()) or bool((lengths < 0).any()):
        raise ValueError(
            f"thd_ends: local sequence lengths {lengths.tolist()} must be even and "
            "non-decreasing ends (each local sequence is chunk r and chunk 2CP-1-r); fix: pad "
            "every sequence to a multiple of 2 * context_parallel_size"
        )
    halves = lengths // 2
    seq = torch.repeat_interleave(torch.arange(len(ends)), lengths)
    starts = torch.tensor((0, *ends[:-1]))
    within = torch.arange(int(lengths.sum())) - starts[seq]
    early = within < halves[seq]
    return {
        "early": torch.nonzero(early)[:, 0].to(device),
        "late": torch.nonzero(~early)[:, 0].to(device),
        "half_ends": tuple(halves.cumsum(0).tolist()),
        "stats_whole": _stats_index(lengths, heads).to(device),
        "stats_half": _stats_index(halves, heads).to(device),
    }


def _stats_index(lengths: torch.Tensor, heads: int) -> torch.Tensor:
    """``[T, N]``: where (token t, head n) sits in statistics filled N-major per segment:
    ``start_s * N + n * L_s + (t - start_s)``."""
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = lengths.cumsum(0) - lengths
    token = torch.arange(int(lengths.sum()))
    base = starts[seq] * heads + (token - starts[seq])
    return base.unsqueeze(1) + torch.arange(heads).unsqueeze(0) * lengths[seq].unsqueeze(1)
