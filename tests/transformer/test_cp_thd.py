"""The pure-PyTorch ``thd_get_partitioned_indices`` against a per-chunk loop written from
Megatron's description (each sequence cut into 2·CP chunks, rank r keeps r and 2·CP-1-r)."""

from __future__ import annotations

import pytest
import torch

from mcore_npu.transformer.context_parallel.thd import (
    check_thd_partitionable,
    local_cu_seqlens,
    thd_get_partitioned_indices,
)


def _by_chunks(lengths: list[int], cp: int, rank: int) -> list[int]:
    kept, start = [], 0
    for length in lengths:
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            kept += range(start + c * chunk, start + (c + 1) * chunk)
        start += length
    return kept


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("lengths", [[8], [8, 4, 16], [16, 8, 0, 8]])
def test_indices_match_the_chunk_layout_and_cover_every_token_once(cp, lengths):
    unit = 2 * cp
    lengths = [n * unit // 4 for n in lengths]  # every length divides by 2·CP
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    parts = [thd_get_partitioned_indices(cu, total, cp, r) for r in range(cp)]
    for rank, part in enumerate(parts):
        assert part.dtype == torch.int64 and part.numel() == total // cp
        assert part.tolist() == _by_chunks(lengths, cp, rank)
    assert sorted(torch.cat(parts).tolist()) == list(range(total))
    assert local_cu_seqlens(cu, cp).tolist() == [int(x) // cp for x in cu]


def test_docstring_example_and_padding_tail():
    cu = torch.tensor([0, 8, 12])
    assert thd_get_partitioned_indices(cu, 12, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert thd_get_partitioned_indices(cu, 12, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert thd_get_partitioned_indices(cu, 16, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 13, 14]


@pytest.mark.parametrize(
    ("args", "error", "names"),
    [
        ((torch.tensor([[0, 4]]), 4, 2, 0), TypeError, "cu_seqlens"),
        ((torch.tensor([0.0, 4.0]), 4, 2, 0), TypeError, "cu_seqlens"),
        ((torch.tensor([0, 4]), 5, 2, 0), ValueError, "total_tokens"),
        ((torch.tensor([0, 4]), 4, 0, 0), ValueError, "world_size"),
        ((torch.tensor([0, 4]), 4, 2, 2), ValueError, "rank"),
    ],
)
def test_bad_arguments_are_named(args, error, names):
    with pytest.raises(error, match=names):
        thd_get_partitioned_indices(*args)


def test_check_names_the_sequence_and_the_fix():
    check_thd_partitionable(torch.tensor([0, 8, 12]), 2)
    with pytest.raises(ValueError, match=r"sequence 1 has padded length 6.*multiple of 4"):
        check_thd_partitionable(torch.tensor([0, 8, 14]), 2)


def test_get_thd_batch_splits_every_packed_tensor_and_keeps_the_global_offsets():
    from mcore_npu import get_thd_batch_on_this_cp_rank

    lengths = [8, 4, 12]
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
    tokens = torch.arange(24).reshape(1, 24)
    batch = {"tokens": tokens, "labels": tokens + 100, "cu_seqlens": cu}
    for rank in range(2):
        local, params = get_thd_batch_on_this_cp_rank(batch, cu, cu, 12, cp_size=2, cp_rank=rank)
        assert local["tokens"].tolist() == [_by_chunks(lengths, 2, rank)]
        assert local["labels"].tolist() == [[t + 100 for t in _by_chunks(lengths, 2, rank)]]
        assert local["cu_seqlens"] is cu  # offsets stay global, as Megatron passes them
        assert params.qkv_format == "thd" and params.cu_seqlens_q_padded is cu
        assert params.max_seqlen_q == 12


def test_get_thd_batch_refuses_a_tensor_that_is_not_packed():
    from mcore_npu import get_thd_batch_on_this_cp_rank

    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"batch\['labels'\]"):
        get_thd_batch_on_this_cp_rank(
            {"tokens": torch.zeros(1, 8), "labels": torch.zeros(1, 4)}, cu, cu, 8, 2, 0
        )
