"""The ring's block schedule, simulated on one process: over all ranks and steps its blocks
keep every (query, key) pair of causal (or causal sliding-window) attention exactly once, and
the packed layout's statistics conversions match the operator's TND statistics."""

from __future__ import annotations

import pytest
import torch

from mcore_npu.ops import fusion_attention_with_stats
from mcore_npu.transformer.context_parallel import chunks
from mcore_npu.transformer.context_parallel.blocks import (
    BOTH,
    CAUSAL,
    EARLY,
    FULL,
    LATE,
    Block,
    PackedLayout,
    schedule,
)


def _positions(rank: int, cp: int, part: str, chunk: int) -> torch.Tensor:
    """Global token positions of a rank's part (its chunks in local order)."""
    early, late = (torch.arange(c * chunk, (c + 1) * chunk) for c in chunks.chunk_ids(rank, cp))
    return {EARLY: early, LATE: late, BOTH: torch.cat([early, late])}[part]


def _block_keep(mask: tuple, rows: int, cols: int) -> torch.Tensor:
    """Kept (True) local pairs of one block: square blocks, band origin bottom-right = top-left."""
    i, j = torch.arange(rows).unsqueeze(1), torch.arange(cols)
    if mask == FULL:
        return torch.ones(rows, cols, dtype=torch.bool)
    if mask == CAUSAL:
        return j <= i
    _, pre, nxt = mask
    assert rows == cols and (pre >= 0 or (nxt >= -pre and -pre < rows)) and nxt >= 0
    return (j - i >= -pre) & (j - i <= nxt)


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 3, 4])
@pytest.mark.parametrize("left", [None, 0, 1, 2, 5, 9, 100])
@pytest.mark.parametrize("split_rows", [False, True])
def test_the_blocks_cover_causal_window_attention_exactly_once(cp, chunk, left, split_rows):
    seq = 2 * cp * chunk
    count = torch.zeros(seq, seq, dtype=torch.int64)
    for rank in range(cp):
        for step in range(cp):
            src = (rank - step) % cp
            for block in schedule(rank, cp, step, left=left, chunk=chunk, split_rows=split_rows):
                q = _positions(rank, cp, block.rows, chunk)
                k = _positions(src, cp, block.keys, chunk)
                keep = _block_keep(block.mask, len(q), len(k))
                count[q.unsqueeze(1).expand_as(keep)[keep], k.expand_as(keep)[keep]] += 1
    i, j = torch.arange(seq).unsqueeze(1), torch.arange(seq)
    wanted = (j <= i) & ((i - j <= left) if left is not None else True)
    assert torch.equal(count, wanted.long())


def test_split_rows_gives_one_call_per_query_chunk_for_earlier_ranks():
    """CP=2, rank 1, step 1 (K/V of rank 0): both query chunks see rank 0's early chunk, as one
    call, or as one call per query chunk with ``split_rows``; rank 0's step 1 is one call."""
    assert schedule(1, 2, 1) == [Block(BOTH, EARLY, FULL)]
    assert schedule(1, 2, 1, split_rows=True) == [
        Block(EARLY, EARLY, FULL),
        Block(LATE, EARLY, FULL),
    ]
    assert schedule(0, 2, 1, split_rows=True) == [Block(LATE, BOTH, FULL)]


def test_packed_statistics_convert_between_the_operator_and_token_order():
    """The operator fills TND statistics N-major per sequence; ``stats_rows`` gives token
    order and ``stats_op`` gives the operator's layout back, for whole sequences and halves."""
    ends, heads = (4, 10, 12, 20), 3
    layout = PackedLayout(ends, heads, "cpu")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, heads, 8, generator=gen) for _ in range(3))
    for part in (BOTH, LATE):
        rows = layout.rows(part)
        lengths = layout.lengths(part)
        _, smax, _ = fusion_attention_with_stats(
            q[rows], k[rows], v[rows], heads, "TND", kernel="reference",
            actual_seq_qlen=lengths, actual_seq_kvlen=lengths,
        )  # fmt: skip
        token_order = layout.stats_rows(smax, part)  # [r, N, 1]
        start = 0
        for end in lengths:  # per sequence: [N, L, 8] in the operator's memory order
            block = smax.reshape(-1)[start * heads * 8 : end * heads * 8].view(heads, -1, 8)
            assert torch.equal(token_order[start:end, :, 0], block[..., 0].T)
            start = end
        assert torch.equal(layout.stats_op(token_order, part), smax)


def test_packed_halves_are_each_sequences_early_and_late_chunk():
    layout = PackedLayout((4, 10, 12, 20), 2, "cpu")
    assert layout.rows(EARLY).tolist() == [0, 1, 4, 5, 6, 10, 12, 13, 14, 15]
    assert layout.rows(LATE).tolist() == [2, 3, 7, 8, 9, 11, 16, 17, 18, 19]
    assert layout.lengths(EARLY) == [2, 5, 6, 10]
    with pytest.raises(ValueError, match="thd_ends"):
        PackedLayout((3, 10), 2, "cpu")
