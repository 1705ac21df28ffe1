"""Megatron's hybrid model in ``mcore-npu train``: configs/gpt_tiny_hybrid.yaml trains (loss down
by 30 % in its 60 steps), configs/nemotron_nano_9b_v2.yaml validates for its node (not run), and
what is refused before any process starts."""

from __future__ import annotations

import sys

import pytest

from mcore_npu.training.config import ConfigError, load_config
from mcore_npu.transformer.hybrid_pattern import symbols
from tests.launch import CONFIGS, assert_ok, train

TINY = CONFIGS / "gpt_tiny_hybrid.yaml"
NEMOTRON = CONFIGS / "nemotron_nano_9b_v2.yaml"
needs_moe_slot = pytest.mark.skipif(
    "E" not in symbols(),
    reason="configs/gpt_tiny_hybrid.yaml has MoE layers (E): the hybrid "
    "stack has their slot from megatron-core 0.16 (hybrid_pattern.SINCE)",
)


@needs_moe_slot
def test_the_tiny_config_builds_megatrons_hybrid_model(megatron_runtime):
    from mcore_npu.training.model import build_model, transformer_config

    cfg = load_config(TINY)
    config = transformer_config(cfg)
    assert config.is_hybrid_model and config.mamba_num_heads == 8
    model = build_model(cfg, config)
    kinds = [type(layer).__name__ for layer in model.decoder.layers]
    assert kinds == ["MambaLayer", "MLPLayer", "MambaLayer", "TransformerLayer", "MambaLayer",
                     "TransformerLayer"]  # fmt: skip
    assert type(model).__name__ in ("MambaModel", "HybridModel")


def test_the_nemotron_config_validates_for_its_node_only():
    """The recipe's layout on 8 NPUs: TP 8, full recompute, bf16 (Nemotron-Nano-9B-v2's shape)."""
    from mcore_npu.training.model import transformer_config

    cfg = load_config(NEMOTRON, world_size=8)
    config = transformer_config(cfg)
    assert (config.num_layers, config.hidden_size, config.mamba_num_heads) == (56, 4480, 128)
    assert (config.mamba_head_dim, config.mamba_num_groups, config.mamba_state_dim) == (80, 8, 128)
    assert config.tensor_model_parallel_size == 8 and config.bf16
    assert config.recompute_granularity == "full" and config.recompute_method == "uniform"
    assert len(cfg.model.hybrid_pattern) == 56 and set(cfg.model.hybrid_pattern) == set("M*-")
    with pytest.raises(ConfigError, match="parallel.tensor"):
        load_config(NEMOTRON, world_size=4)


BAD = [
    (["model.hybrid_pattern=M*X-ME"], "has ['X']"),
    (["model.hybrid_pattern=M*"], "has 2 layers, model.num_layers is 6"),
    (["attention.backend=local"], "npu_fusion spec in the te layout"),
    (["model.param_layout=local"], "npu_fusion spec in the te layout"),
    (["model.num_moe_experts=null"], "without experts"),
    (["model.mamba_num_groups=3"], "mamba_num_groups"),
]


@needs_moe_slot
@pytest.mark.parametrize("overrides, problem", BAD, ids=[b[1] for b in BAD])
def test_hybrid_configs_that_cannot_work_are_refused_naming_the_key(overrides, problem):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    assert str(info.value).startswith("config model."), str(info.value)
    assert problem in str(info.value) and "\n" not in str(info.value)


@needs_moe_slot
@pytest.mark.slow
@pytest.mark.cpu_only
def test_the_tiny_hybrid_config_trains_and_loss_falls_by_30_percent(tmp_path):
    """``mcore-npu train --config configs/gpt_tiny_hybrid.yaml`` as written: 60 steps of the tiny
    hybrid (Mamba, MLP, attention and MoE layers) lower the loss by at least 30 %."""
    run = assert_ok(train([], config="gpt_tiny_hybrid.yaml", metrics=tmp_path / "m.jsonl"))
    first, last = run.losses[0], run.losses[-1]
    assert len(run.losses) == 60
    assert last <= 0.7 * first, (first, last)
    print(f"gpt_tiny_hybrid: loss {first:.2f} -> {last:.2f} in 60 steps", file=sys.stderr)
    assert "mcore-npu train: done steps=60" in run.stdout
