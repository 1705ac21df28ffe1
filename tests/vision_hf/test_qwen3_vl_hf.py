"""A tiny Qwen3-VL (tests/vision_hf/qwen3_vl_models.py) through the plugin's vision tower and
language model (``mcore_npu.integrations.hf_qwen3_vl``) against transformers' own model, fp32,
reference kernels, one process.

Checked: the mRoPE positions equal ``get_rope_index`` (text, two images of different grids, a
two-frame video, left and right padding); the vision tower's merged and deepstack features and
the whole model's logits (two images of different grids in one sequence, deepstack on both
blocks) are within 1e-4; text only too; two image+text samples packed verl's way give each its
own logits; one backward reaches every parameter; export is bit-exact; neither
transformer_engine nor flash_attn is imported. The MoE form (Qwen3-VL-MoE: 4 experts, top-2, a
dense first layer) gives transformers' logits with images and text only, and its experts load
and export bit-exact in transformers 5's layout and the hub's."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("transformers.models.qwen3_vl")

from tests.vision_hf.qwen3_vl_models import GRIDS, IMAGE, VIDEO, image_prompt, pixels, tiny_model

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("cpu_runtime")]

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def pair():
    """``(transformers model, plugin model)`` with the same weights."""
    from mcore_npu.integrations import hf_qwen3_vl, hf_qwen3_vl_weights

    hf = tiny_model()
    model = hf_qwen3_vl.build_qwen3_vl(hf.config, kernel="reference").eval()
    hf_qwen3_vl_weights.load_qwen3_vl_weights(model, hf.state_dict())
    return hf, model


def _hf_logits(hf, ids, px=None, grid=None):
    kinds = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    with torch.no_grad():
        if px is None:
            return hf(input_ids=ids).logits
        return hf(
            input_ids=ids, pixel_values=px, image_grid_thw=grid, mm_token_type_ids=kinds
        ).logits


def test_positions_equal_transformers_get_rope_index(pair):
    from mcore_npu.transformer.vision import rope_index

    hf, _ = pair
    first = image_prompt(GRIDS)[0]
    video = [5, 152] + [VIDEO] * 4 + [153, 3, 152] + [VIDEO] * 4 + [153, 4, 4]
    width = len(first) + 3
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    ids[0, : len(first)], mask[0, : len(first)] = first, 1  # right padding
    ids[1, width - len(video) :], mask[1, width - len(video) :] = torch.tensor(video), 1  # left
    images, videos = torch.tensor(GRIDS), torch.tensor([[2, 4, 4]])  # 2 frames of 2 x 2 tokens
    kinds = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    want, _ = hf.model.get_rope_index(ids, kinds, images, videos, mask)
    got = rope_index(
        ids,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        spatial_merge_size=2,
        image_grid_thw=images,
        video_grid_thw=videos,
        attention_mask=mask,
    )
    assert torch.equal(got, want)
    assert got[1:, 0].max() < got[0, 0].max() + 1  # images did move h, w apart from t
    assert not torch.equal(got[1], got[0])


def test_image_ids_without_grids_are_text_as_transformers_reads_them(pair):
    """Text whose ids happen to include the image and video ids, given no grid: transformers
    takes every token as text (one position per token), and so does ``rope_index``."""
    from mcore_npu.transformer.vision import rope_index

    hf, model = pair
    ids = torch.tensor([[5, IMAGE, 7, VIDEO, IMAGE, 9]])
    got = rope_index(ids, image_token_id=IMAGE, video_token_id=VIDEO, spatial_merge_size=2)
    assert torch.equal(got, torch.arange(6).expand(3, 1, 6))
    with torch.no_grad():
        assert (model(ids) - _hf_logits(hf, ids)).abs().max() <= TOLERANCE


def test_vision_tower_matches_transformers(pair):
    hf, model = pair
    grid = torch.tensor(GRIDS)
    px = pixels(GRIDS)
    with torch.no_grad():
        want = hf.model.visual(px, grid_thw=grid)
        got, deepstack = model.vision(px, grid)
    assert got.shape == want.pooler_output.shape == (10, 48)
    assert (got - want.pooler_output).abs().max() <= TOLERANCE
    assert len(deepstack) == len(want.deepstack_features) == 2
    for ours, theirs in zip(deepstack, want.deepstack_features):
        assert (ours - theirs).abs().max() <= TOLERANCE


def test_logits_match_transformers_with_two_images(pair):
    hf, model = pair
    ids, grid, px = image_prompt(GRIDS), torch.tensor(GRIDS), pixels(GRIDS)
    want = _hf_logits(hf, ids, px, grid)
    with torch.no_grad():
        got = model(ids, pixel_values=px, image_grid_thw=grid)
        text_positions = torch.arange(ids.shape[1]).expand(3, 1, -1)
        without_images = model.language_model(ids, text_positions, None)
    assert got.shape == want.shape == (1, ids.shape[1], 160)
    assert (got - want).abs().max() <= TOLERANCE
    assert (without_images - want).abs().max() > 100 * TOLERANCE  # the images matter


def test_text_only_is_the_language_model(pair):
    hf, model = pair
    ids = torch.randint(0, 140, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(ids)
        given = model(ids, position_ids=torch.arange(11).expand(2, -1))  # [B, S] text positions
    want = _hf_logits(hf, ids)
    assert (got - want).abs().max() <= TOLERANCE and torch.equal(given, got)


def _verl_packed_batch():
    """Two image+text samples as verl hands them in thd: padded ``[2, S]`` ids (right and left
    padding), the bool mask (**True = token**) and ``PackedSeqParams`` over the valid tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    first, second = image_prompt(GRIDS)[0], image_prompt([(1, 4, 6)], text=((7,), (3, 4)))[0]
    width = len(first) + 4
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.bool)
    ids[0, : len(first)], mask[0, : len(first)] = first, True
    ids[1, width - len(second) :], mask[1, width - len(second) :] = second, True
    lengths = mask.sum(-1).int()
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    longest = int(lengths.max())
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    return (first, second), ids, mask, params


def test_packed_samples_each_get_their_own_logits(pair):
    hf, model = pair
    (first, second), ids, mask, params = _verl_packed_batch()
    grids = (*GRIDS, (1, 4, 6))
    px = torch.cat((pixels(GRIDS), pixels([(1, 4, 6)], seed=5)))
    with torch.no_grad():
        got = model(
            ids,
            attention_mask=mask,
            pixel_values=px,
            image_grid_thw=torch.tensor(grids),
            packed_seq_params=params,
        )
    want_first = _hf_logits(hf, first[None], pixels(GRIDS), torch.tensor(GRIDS))[0]
    want_second = _hf_logits(
        hf, second[None], pixels([(1, 4, 6)], seed=5), torch.tensor([(1, 4, 6)])
    )[0]
    assert got.shape == (1, len(first) + len(second), 160)
    assert (got[0, : len(first)] - want_first).abs().max() <= TOLERANCE
    assert (got[0, len(first) :] - want_second).abs().max() <= TOLERANCE


def test_one_backward_reaches_every_parameter(pair):
    _, model = pair
    (_, _), ids, mask, params = _verl_packed_batch()
    px = torch.cat((pixels(GRIDS), pixels([(1, 4, 6)], seed=5)))
    model.zero_grad(set_to_none=True)
    logits = model(
        ids,
        attention_mask=mask,
        pixel_values=px,
        image_grid_thw=torch.tensor((*GRIDS, (1, 4, 6))),
        packed_seq_params=params,
    )
    logits.float().logsumexp(-1).mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), [
        n for n, g in grads.items() if g is None
    ]
    for name in (
        "vision.patch_embed.proj.weight",
        "vision.merger.linear_fc2.weight",
        "vision.deepstack_merger_list.0.linear_fc1.weight",
        "vision.deepstack_merger_list.1.norm.weight",
    ):
        assert grads[name].abs().sum() > 0, name
    model.zero_grad(set_to_none=True)


def test_export_is_bit_exact(pair):
    from mcore_npu.integrations import hf_qwen3_vl_weights

    hf, model = pair
    want = hf.state_dict()
    got = hf_qwen3_vl_weights.export_qwen3_vl_weights(model)
    assert set(got) == set(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert sum(name.startswith("model.visual.") for name in got) == 45  # 3 + 2 x 12 + 6 + 2 x 6


def test_neither_transformer_engine_nor_flash_attn_is_imported(pair):
    assert not any(
        name.split(".")[0] in ("transformer_engine", "flash_attn") for name in sys.modules
    )


@pytest.fixture(scope="module")
def moe_pair():
    """``(transformers Qwen3-VL-MoE, plugin model)`` with the same weights."""
    from mcore_npu.integrations import hf_qwen3_vl, hf_qwen3_vl_weights

    hf = tiny_model(moe=True)
    model = hf_qwen3_vl.build_qwen3_vl(hf.config, kernel="reference").eval()
    hf_qwen3_vl_weights.load_qwen3_vl_weights(model, hf.state_dict())
    return hf, model


def test_moe_logits_match_transformers_with_two_images_and_text_only(moe_pair):
    hf, model = moe_pair
    assert model.language_model.config.num_moe_experts == 4
    ids, grid, px = image_prompt(GRIDS), torch.tensor(GRIDS), pixels(GRIDS)
    with torch.no_grad():
        got = model(ids, pixel_values=px, image_grid_thw=grid)
        text = torch.randint(0, 140, (2, 11), generator=torch.Generator().manual_seed(3))
        got_text = model(text)
    assert (got - _hf_logits(hf, ids, px, grid)).abs().max() <= TOLERANCE
    assert (got_text - _hf_logits(hf, text)).abs().max() <= TOLERANCE


@pytest.mark.parametrize("layout", ["transformers", "hub"])
def test_moe_experts_load_and_export_in_either_layout(moe_pair, layout):
    """transformers 5's ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` and the hub's
    transposes load to the same model, and export gives back the layout loaded, bit-exact."""
    from mcore_npu.integrations import hf_qwen3_vl, hf_qwen3_vl_weights

    hf, reference = moe_pair
    state = hf.state_dict()
    if layout == "hub":
        state = {k: v.transpose(1, 2).contiguous() if ".experts." in k else v
                 for k, v in state.items()}  # fmt: skip
    assert state["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (
        (4, 64, 48) if layout == "transformers" else (4, 48, 64)
    )
    model = hf_qwen3_vl.build_qwen3_vl(hf.config, kernel="reference").eval()
    hf_qwen3_vl_weights.load_qwen3_vl_weights(model, state)
    assert model.hf_expert_layout == layout
    loaded = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        assert torch.equal(loaded[name], param), name
    exported = hf_qwen3_vl_weights.export_qwen3_vl_weights(model)
    assert set(exported) == set(state)
    assert all(torch.equal(exported[name], state[name]) for name in state)
