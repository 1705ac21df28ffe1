"""Qwen3-VL's positions, written out by hand for small cases (transformers' own
``get_rope_index`` is compared in tests/vision_hf), and the refusals naming the argument."""

from __future__ import annotations

import pytest
import torch

from mcore_npu.transformer.vision import positions, rope_index

IMAGE, VIDEO = 9, 8


def test_text_then_image_then_text_by_hand():
    # t0 t1 | image of 2 x 4 patches -> 1 x 2 tokens after the 2 x 2 merge | t2
    ids = torch.tensor([[1, 2, IMAGE, IMAGE, 3]])
    got = rope_index(
        ids,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        spatial_merge_size=2,
        image_grid_thw=torch.tensor([[1, 2, 4]]),
    )
    want = torch.tensor([[0, 1, 2, 2, 4], [0, 1, 2, 2, 4], [0, 1, 2, 3, 4]])
    assert torch.equal(got[:, 0], want)  # the text after resumes at start + max(1, 2)


def test_padding_gets_zero_and_rows_count_from_their_first_token():
    ids = torch.tensor([[0, 0, 5, 6], [5, 6, 7, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0]])  # True / 1 = token
    got = rope_index(
        ids, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2, attention_mask=mask
    )
    assert torch.equal(got[0], torch.tensor([[0, 0, 0, 1], [0, 1, 2, 0]]))


def test_every_video_frame_is_its_own_group():
    ids = torch.tensor([[VIDEO, 1, VIDEO]])  # 2 frames of 2 x 2 patches: one token each
    got = rope_index(
        ids,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        spatial_merge_size=2,
        video_grid_thw=torch.tensor([[2, 2, 2]]),
    )
    assert torch.equal(got[:, 0], torch.tensor([[0, 1, 2]] * 3))


@pytest.mark.parametrize(
    ("ids", "grids", "message"),
    [
        ([[IMAGE, IMAGE, IMAGE]], [[1, 2, 4]], "grid \\(1, 2, 4\\) gives 2 tokens"),
        ([[IMAGE, 1, IMAGE]], [[1, 2, 2]], "more runs of its tokens"),
        ([[1, IMAGE]], [[1, 2, 2], [1, 2, 2]], "2 grids but 1 runs"),
    ],
)
def test_grids_that_do_not_fit_the_tokens_are_refused(ids, grids, message):
    with pytest.raises(ValueError, match=f"rope_index: image_grid_thw: .*{message}"):
        rope_index(
            torch.tensor(ids),
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            spatial_merge_size=2,
            image_grid_thw=torch.tensor(grids),
        )


def test_patch_rows_and_columns_come_in_merge_order():
    got = positions.patch_positions(torch.tensor([[1, 2, 4]]), 2)
    rows_cols = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    assert got.tolist() == [list(p) for p in rows_cols]


def test_bilinear_corner_weights_sum_to_one_and_hit_the_table_corners():
    index, weight = positions.bilinear_corners(torch.tensor([[1, 4, 6]]), 4, 2)
    assert index.shape == weight.shape == (4, 24)
    torch.testing.assert_close(weight.sum(0), torch.ones(24))
    assert index.min() == 0 and index.max() == 15
    assert torch.equal(
        positions.frame_cu_seqlens(torch.tensor([[2, 2, 4], [1, 4, 6]])),
        torch.tensor([0, 8, 16, 40], dtype=torch.int32),
    )
