"""Uneven pipeline stages: ``megatron_stage_layout`` against Megatron-Core's own placement, and the
NPU decoder-block spec sliced for uneven stages.

Each expected placement is asked of Megatron itself (``get_num_layers_to_build``,
``get_transformer_layer_offset``, the layout object) for every (pipeline rank, virtual stage),
with Megatron's parallel-state rank overrides standing in for the other ranks.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from mcore_npu.transformer.pipeline_layout import (
    StageLayoutError,
    megatron_stage_layout,
    stages_from_first_last,
)
from tests.transformer.moe_models import module_of

pytestmark = pytest.mark.cpu_only

CASES = [  # per_stage, num_layers, pp, vpp, the keys expected
    ([[3], [3]], 6, 2, None, {}),
    ([2, 4], 6, 2, None, {"num_layers_in_first_pipeline_stage": 2}),
    ([[4], [2]], 6, 2, None, {"num_layers_in_first_pipeline_stage": 4}),
    ([1, 2, 2, 1], 6, 4, None,
     {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 1}),
    ([[2], [1], [1], [2]], 6, 4, None,
     {"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2}),
    ([[6], [8], [8], [6]], 28, 4, None,
     {"num_layers_in_first_pipeline_stage": 6, "num_layers_in_last_pipeline_stage": 6}),
    ([3, 3, 3, 1], 10, 4, None, {"num_layers_in_last_pipeline_stage": 1}),
    ([[1, 1], [2, 2]], 6, 2, 2, {"num_layers_in_first_pipeline_stage": 2}),
    ([[1, 1], [2, 2], [2, 2], [1, 1]], 12, 4, 2,
     {"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2}),
    ([[1], [3], [2], [2]], 8, 4, None, {"pipeline_model_parallel_layout": "Et|ttt|tt|ttL"}),
    ([[0], [3], [3], [2]], 8, 4, None, {"pipeline_model_parallel_layout": "E|ttt|ttt|ttL"}),
    ([[1, 2], [2, 1]], 6, 2, 2, {"pipeline_model_parallel_layout": "Et|tt|tt|tL"}),
    ([[5]], 5, 1, None, {}),
]  # fmt: skip


@pytest.mark.parametrize("per_stage, num_layers, pp, vpp, expected", CASES)
def test_megatron_places_the_layers_where_the_list_says(per_stage, num_layers, pp, vpp, expected):
    fields = megatron_stage_layout(per_stage, num_layers=num_layers, pipeline_size=pp,
                                   vpp_size=vpp)  # fmt: skip
    assert fields == expected
    config = _config(num_layers, pp, vpp, **fields)
    wanted = _wanted_layer_ids(per_stage, vpp)
    for (rank, stage), layer_ids in wanted.items():
        assert _megatron_layer_ids(config, rank, stage, vpp) == layer_ids, (rank, stage)


@pytest.mark.parametrize(
    "per_stage, vpp",
    [([1, 3, 3, 1], None), ([[1], [3], [2], [2]], None), ([[0], [3], [3], [2]], None),
     ([[1, 1], [1, 1], [1, 1], [1, 1]], 2), ([[1, 2], [1, 1], [1, 1], [1, 0]], 2)],
)  # fmt: skip
def test_the_npu_block_spec_slices_uneven_stages_with_the_layer_pattern(per_stage, vpp):
    """MoE and dense layers by global position: each (virtual) stage's spec holds its slice."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    pattern = [1, 0, 0, 1, 1, 0, 1, 0]
    fields = megatron_stage_layout(per_stage, num_layers=8, pipeline_size=4, vpp_size=vpp)
    config = _config(8, 4, vpp, num_moe_experts=4, moe_layer_freq=pattern,
                     moe_ffn_hidden_size=32, moe_router_topk=2, **fields)  # fmt: skip
    for (rank, stage), layer_ids in _wanted_layer_ids(per_stage, vpp).items():
        vp_stage = stage if vpp else None
        with _pipeline_rank(rank, vpp):
            block = get_gpt_decoder_block_npu_spec(config, kernel="reference", pp_rank=rank,
                                                   vp_stage=vp_stage)  # fmt: skip
        # MoELayer, or on 0.15 (no router slot) its subclass with the NPU router
        moe = [issubclass(module_of(spec.submodules.mlp), MoELayer) for spec in block.layer_specs]
        assert moe == [bool(pattern[i]) for i in layer_ids], (rank, stage)


@pytest.mark.usefixtures("megatron_runtime")
@pytest.mark.parametrize("param_layout", ["te", "local"])
def test_uneven_stages_build_their_layers_and_only_the_last_its_final_norm(param_layout):
    from megatron.core.models.gpt import GPTModel

    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec
    from tests.transformer.megatron_models import VOCAB

    per_stage = [[1], [3], [2], [2]]
    fields = megatron_stage_layout(per_stage, num_layers=8, pipeline_size=4)
    config = _config(8, 4, None, **fields)
    for (rank, _), layer_ids in _wanted_layer_ids(per_stage, None).items():
        with _pipeline_rank(rank, None):
            spec = get_gpt_decoder_block_npu_spec(config, kernel="reference",
                                                  param_layout=param_layout)  # fmt: skip
            model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=32,
                             pre_process=rank == 0, post_process=rank == 3)  # fmt: skip
        numbers = [layer.layer_number for layer in model.decoder.layers]
        assert numbers == [i + 1 for i in layer_ids], rank
        names = model.state_dict().keys()
        has_norm = any(name.startswith("decoder.final_layernorm.") for name in names)
        assert has_norm == (rank == 3), rank
        extra = "decoder.final_layernorm._extra_state" in names
        assert extra == (rank == 3 and param_layout == "te"), rank


@pytest.mark.parametrize(
    "per_stage, pp, vpp, words",
    [
        ([[6], [8], [8], [6]], 4, None, ["adds up to 28 layers", "num_layers is 24",
                                         "[[6], [8], [8], [6]]"]),
        ([2, 2, 2], 2, None, ["has 3 stages", "pipeline parallel size is 2"]),
        ([6, 6, 6, 6], 4, 2, ["flat list", "2 virtual stages"]),
        ([[3, 3], [6], [6], [6]], 4, 2, ["[6] has 1 counts", "2 virtual stage"]),
        ([[7], [-1], [9], [9]], 4, None, ["-1 is not a layer count"]),
        ([[6], [6.0], [6], [6]], 4, None, ["6.0 is not a layer count"]),
        ("6,6,6,6", 4, None, ["is not a list"]),
    ],
)  # fmt: skip
def test_refusals_name_the_key_the_list_and_what_is_wrong(per_stage, pp, vpp, words):
    with pytest.raises(ValueError) as caught:
        megatron_stage_layout(per_stage, num_layers=24, pipeline_size=pp, vpp_size=vpp)
    message = str(caught.value)
    assert message.startswith("pipeline_num_transformer_layers=")
    for word in words:
        assert word in message, message
    assert isinstance(caught.value, StageLayoutError)


def test_the_sum_refusal_says_what_to_do():
    with pytest.raises(ValueError, match=r"make the counts add up to 10, or set num_layers to 9"):
        megatron_stage_layout([4, 5], num_layers=10, pipeline_size=2)


@pytest.mark.parametrize(
    "first, last, num_layers, pp, expected",
    [
        (1, 1, 6, 4, [1, 2, 2, 1]),
        (2, None, 6, 2, [2, 4]),
        (None, 4, 6, 2, [2, 4]),
        (2, 4, 6, 2, [2, 4]),
        (None, 1, 7, 3, [3, 3, 1]),
        (None, None, 6, 3, [2, 2, 2]),
    ],
)
def test_first_and_last_stage_counts_mean_these_stages(first, last, num_layers, pp, expected):
    stages = stages_from_first_last(first, last, num_layers=num_layers, pipeline_size=pp)
    assert stages == expected
    fields = {"num_layers_in_first_pipeline_stage": first,
              "num_layers_in_last_pipeline_stage": last}  # fmt: skip
    config = _config(num_layers, pp, None, **fields)
    for (rank, stage), layer_ids in _wanted_layer_ids(expected, None).items():
        assert _megatron_layer_ids(config, rank, stage, None) == layer_ids


@pytest.mark.parametrize(
    "first, last, num_layers, pp, words",
    [
        (0, None, 6, 2, ["num_layers_in_first_pipeline_stage=0", ">= 1"]),
        (None, 2, 6, 1, ["num_layers_in_last_pipeline_stage=2", "pipeline parallel size > 1"]),
        (2, 3, 6, 2, ["hold 5 of 6 layers", "add up to 6"]),
        (1, 1, 7, 4, ["leaves 5 of 7 layers for 2 middle stage(s)"]),
        (3, 3, 6, 3, ["leaves 0 of 6 layers for 1 middle stage(s)"]),
    ],
)
def test_first_and_last_refusals(first, last, num_layers, pp, words):
    with pytest.raises(ValueError) as caught:
        stages_from_first_last(first, last, num_layers=num_layers, pipeline_size=pp)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def _config(num_layers, pp, vpp, **fields):
    from tests.transformer.megatron_models import tiny_config

    return tiny_config(num_layers=num_layers, pipeline_model_parallel_size=pp,
                       virtual_pipeline_model_parallel_size=vpp, pipeline_dtype=torch.float32,
                       **{k: v for k, v in fields.items() if v is not None})  # fmt: skip


def _wanted_layer_ids(per_stage, vpp) -> dict[tuple[int, int], list[int]]:
    """(pipeline rank, virtual stage) -> global layer ids, in Megatron's interleaved order."""
    stages = [entry if isinstance(entry, list) else [entry] for entry in per_stage]
    wanted, next_id = {}, 0
    for stage in range(vpp or 1):
        for rank, counts in enumerate(stages):
            wanted[(rank, stage)] = list(range(next_id, next_id + counts[stage]))
            next_id += counts[stage]
    return wanted


@contextlib.contextmanager
def _pipeline_rank(rank: int, vpp):
    from megatron.core import parallel_state

    parallel_state.set_pipeline_model_parallel_rank(rank)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_rank(None)
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def _megatron_layer_ids(config, rank: int, stage: int, vpp) -> list[int]:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    vp_stage = stage if vpp else None
    with _pipeline_rank(rank, vpp):
        count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=rank)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=rank)
    return list(range(offset, offset + count))


@pytest.mark.parametrize(
    "per_stage, first, last, expected",
    [
        ([[11], [13], [13], [11]], 11, 11,  # as verl's Ascend Qwen3-30B recipes write it
         {"num_layers_in_first_pipeline_stage": 11, "num_layers_in_last_pipeline_stage": 11}),
        ([[11], [13], [13], [11]], None, 11,
         {"num_layers_in_first_pipeline_stage": 11, "num_layers_in_last_pipeline_stage": 11}),
        ([[10], [14], [12], [12]], 10, None, {"pipeline_model_parallel_layout":
                                              "E" + "t" * 10 + "|" + "t" * 14 + "|" + "t" * 12
                                              + "|" + "t" * 12 + "L"}),
        (None, 11, 11,
         {"num_layers_in_first_pipeline_stage": 11, "num_layers_in_last_pipeline_stage": 11}),
        (None, None, 12, {"num_layers_in_last_pipeline_stage": 12}),
    ],
)  # fmt: skip
def test_a_recipes_first_last_counts_beside_its_list(per_stage, first, last, expected):
    from mcore_npu.transformer.pipeline_layout import resolve_stage_keys

    fields = resolve_stage_keys(per_stage, num_layers=48, pipeline_size=4, first=first, last=last)
    assert fields == expected
    _config(48, 4, None, **fields)  # Megatron takes them together


@pytest.mark.parametrize(
    "per_stage, first, last, words",
    [
        ([[11], [13], [13], [11]], 12, 11, ["num_layers_in_first_pipeline_stage=12: disagrees "
                                            "with pipeline_num_transformer_layers=[[11], [13], "
                                            "[13], [11]], whose stage holds 11 layers"]),
        ([11, 13, 13, 11], 11, 13, ["num_layers_in_last_pipeline_stage=13: disagrees"]),
        ([11, 13, 13, 12], 11, 11, ["adds up to 49 layers but num_layers is 48"]),
        (None, 11, 10, ["leaves 27 of 48 layers for 2 middle stage(s)"]),
    ],
)  # fmt: skip
def test_a_recipes_disagreeing_counts_are_refused(per_stage, first, last, words):
    from mcore_npu.transformer.pipeline_layout import resolve_stage_keys

    with pytest.raises(ValueError) as caught:
        resolve_stage_keys(per_stage, num_layers=48, pipeline_size=4, first=first, last=last)
    for word in words:
        assert word in str(caught.value), str(caught.value)
