"""Uneven pipeline stages in the trainer's YAML: ``parallel.first_stage_layers`` /
``last_stage_layers`` and ``parallel.pipeline_num_transformer_layers``, validated before any
process group starts and turned into Megatron's own ``TransformerConfig`` keys."""

from __future__ import annotations

import pytest

from mcore_npu.training.config import ConfigError, load_config
from tests.training.test_config import CONFIGS

UNEVEN = CONFIGS / "gpt_tiny_pp_uneven.yaml"
EVEN = ["parallel.first_stage_layers=null", "parallel.last_stage_layers=null"]


def test_the_shipped_uneven_config_builds_megatrons_first_and_last_stage_counts():
    from mcore_npu.training.model import transformer_config

    cfg = load_config(UNEVEN, world_size=4)
    config = transformer_config(cfg)
    assert (config.num_layers, config.pipeline_model_parallel_size) == (6, 4)
    assert config.num_layers_in_first_pipeline_stage == 1
    assert config.num_layers_in_last_pipeline_stage == 1
    assert config.pipeline_model_parallel_layout is None


@pytest.mark.parametrize(
    "per_stage, first, last, layout",
    [
        ("[[1],[2],[2],[1]]", 1, 1, None),
        ("[2,1,1,2]", 2, 2, None),
        ("[[1],[2],[1],[2]]", None, None, "Et|tt|t|ttL"),
    ],
)
def test_the_per_stage_list_reaches_megatron(per_stage, first, last, layout):
    from mcore_npu.training.model import transformer_config

    overrides = [*EVEN, f"parallel.pipeline_num_transformer_layers={per_stage}"]
    config = transformer_config(load_config(UNEVEN, overrides, world_size=4))
    assert config.num_layers_in_first_pipeline_stage == first
    assert config.num_layers_in_last_pipeline_stage == last
    assert str(config.pipeline_model_parallel_layout) == str(layout)


def test_first_and_last_counts_beside_the_list_are_accepted_when_they_are_the_lists():
    """As verl's Ascend recipes write it: the list and its own first/last counts together."""
    from mcore_npu.training.model import transformer_config

    for per_stage, layout in (("[[1],[2],[2],[1]]", None), ("[[1],[3],[1],[1]]", "Et|ttt|t|tL")):
        overrides = [f"parallel.pipeline_num_transformer_layers={per_stage}"]
        config = transformer_config(load_config(UNEVEN, overrides, world_size=4))
        assert str(config.pipeline_model_parallel_layout) == str(layout)
        if layout is None:
            assert config.num_layers_in_first_pipeline_stage == 1
            assert config.num_layers_in_last_pipeline_stage == 1
        else:  # Megatron takes the layout alone; the agreeing counts are not passed on
            assert config.num_layers_in_first_pipeline_stage is None
            assert config.num_layers_in_last_pipeline_stage is None


def test_an_even_split_sets_no_stage_keys():
    from mcore_npu.training.model import transformer_config

    config = transformer_config(load_config(UNEVEN, ["model.num_layers=8", *EVEN], world_size=4))
    assert config.num_layers_in_first_pipeline_stage is None
    assert config.pipeline_model_parallel_layout is None


BAD = [
    ([*EVEN, "parallel.pipeline_num_transformer_layers=[[2],[2],[2],[2]]"],
     "config parallel.pipeline_num_transformer_layers=[[2], [2], [2], [2]]: adds up to 8 layers "
     "but num_layers is 6; make the counts add up to 6, or set num_layers to 8"),
    ([*EVEN, "parallel.pipeline_num_transformer_layers=[3,3]"],
     "config parallel.pipeline_num_transformer_layers=[3, 3]: has 2 stages but the pipeline "
     "parallel size is 4"),
    (["parallel.pipeline_num_transformer_layers=[2,1,1,2]"],
     "config parallel.first_stage_layers=1: disagrees with pipeline_num_transformer_layers="
     "[2, 1, 1, 2], whose stage holds 2 layers; make it 2, or leave it out (the list says it)"),
    (["parallel.first_stage_layers=null", "parallel.pipeline_num_transformer_layers=[1,1,2,2]"],
     "config parallel.last_stage_layers=1: disagrees with"),
    (["parallel.first_stage_layers=2"],
     "config parallel.first_stage_layers=2: leaves 3 of 6 layers for 2 middle stage(s)"),
    (["parallel.last_stage_layers=0"], "config parallel.last_stage_layers=0: must be a whole"),
    (["parallel.pipeline=1"],
     "config parallel.first_stage_layers=1: needs a pipeline parallel size > 1"),
    ([*EVEN], "config parallel.pipeline=4: does not divide model.num_layers=6"),
    (["model.num_layers_in_first_pipeline_stage=1"],
     "config model.num_layers_in_first_pipeline_stage=1: is set from another part of this "
     "config; set parallel.first_stage_layers instead"),
    (["model.pipeline_model_parallel_layout=Et|t"],
     "set parallel.pipeline_num_transformer_layers instead"),
]  # fmt: skip


@pytest.mark.parametrize("overrides, message", BAD)
def test_bad_stage_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as caught:
        load_config(UNEVEN, overrides, world_size=4)
    assert message in str(caught.value)
