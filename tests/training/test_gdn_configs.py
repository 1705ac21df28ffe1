"""Gated DeltaNet hybrids in ``mcore-npu train``: configs/gpt_tiny_gdn.yaml trains (loss down by
30 % in its 60 steps), configs/ascend_qwen3_5_35b_a3b.yaml validates for its node (not run), and
what is refused before any process starts."""

from __future__ import annotations

import sys

import pytest

from mcore_npu.training.config import ConfigError, load_config
from tests.launch import CONFIGS, assert_ok, train
from tests.megatron_features import GDN_CONFIG_FIELDS, needs_fields

pytestmark = needs_fields(*GDN_CONFIG_FIELDS, feature="Gated DeltaNet")

TINY = CONFIGS / "gpt_tiny_gdn.yaml"
QWEN = CONFIGS / "ascend_qwen3_5_35b_a3b.yaml"


def test_the_tiny_config_builds_a_gdn_config_with_megatrons_pattern():
    from mcore_npu.training.model import transformer_config
    from mcore_npu.transformer.gated_delta_net import GDNTransformerConfig, linear_attention_pattern

    config = transformer_config(load_config(TINY))
    assert type(config) is GDNTransformerConfig
    assert linear_attention_pattern(config) == [1, 1, 1, 0]
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (2, 4)
    assert config.num_moe_experts == 4 and config.moe_shared_expert_intermediate_size == 64
    assert config.layernorm_zero_centered_gamma and config.attention_output_gate
    assert config.moe_shared_expert_gate and load_config(TINY).model.rotary_percent == 0.25


def test_the_qwen3_5_config_validates_for_its_node_only():
    """The nightly layout on 16 NPUs: TP 2 x PP 2 (DP 4), EP 8 over DP x TP with expert TP 1."""
    from mcore_npu.training.model import transformer_config

    cfg = load_config(QWEN, world_size=16)
    config = transformer_config(cfg)
    assert (config.num_layers, config.hidden_size, config.kv_channels) == (40, 2048, 256)
    assert (config.linear_key_head_dim, config.linear_num_key_heads,
            config.linear_num_value_heads) == (128, 16, 32)  # fmt: skip
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (
        256, 8, 512)  # fmt: skip
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
            config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (
        2, 2, 8, 1)  # fmt: skip
    assert config.sequence_parallel and config.bf16 and config.moe_grouped_gemm
    assert config.recompute_granularity == "full" and config.recompute_method == "uniform"
    assert cfg.fused.moe_permute == "torch_npu" and not cfg.data.pack_sequences
    assert config.layernorm_zero_centered_gamma and config.attention_output_gate
    assert config.moe_shared_expert_gate and cfg.model.rotary_percent == 0.25
    with pytest.raises(ConfigError, match="parallel.expert"):  # ETP 2: 8 ranks / 2 < EP 8
        load_config(QWEN, ["parallel.expert_tensor=null"], world_size=16)
    with pytest.raises(ConfigError, match="parallel.tensor"):  # TP x PP = 4 ranks a replica
        load_config(QWEN, world_size=6)


def test_the_qwen3_5_config_admits_context_parallel():
    """Megatron's own config refuses GDN under CP; the trainer's (GDNTransformerConfig) takes
    the 32k recipes' CP 4 (16 key heads / (TP 2 x CP 4) = 2 per rank)."""
    from mcore_npu.training.model import transformer_config

    cfg = load_config(QWEN, ["parallel.context=4", "parallel.cp_comm_type=all_gather",
                             "parallel.pipeline=1"], world_size=16)  # fmt: skip
    assert transformer_config(cfg).context_parallel_size == 4


BAD = [
    (["attention.backend=local"], "model.experimental_attention_variant"),
    (["model.linear_num_value_heads=3"], "model.linear_num_value_heads"),
    (["model.linear_attention_freq=null"], "model.linear_attention_freq"),
    (["parallel.context=4"], "model.linear_num_key_heads"),  # 2 key heads over 4 CP ranks
    (["parallel.expert_tensor=0"], "parallel.expert_tensor"),
    (["model.rotary_percent=0"], "model.rotary_percent"),
]


@pytest.mark.parametrize("overrides, key", BAD, ids=[b[1] for b in BAD])
def test_gdn_configs_that_cannot_work_are_refused_naming_the_key(overrides, key):
    world = 4 if "parallel.context=4" in overrides else 1
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides, world_size=world)
    assert str(info.value).startswith(f"config {key}"), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.slow
@pytest.mark.cpu_only
def test_the_tiny_gdn_config_trains_and_loss_falls_by_30_percent(tmp_path):
    """``mcore-npu train --config configs/gpt_tiny_gdn.yaml`` as written: 60 steps of the tiny
    hybrid MoE (3 GDN layers, 1 full-attention layer) lower the loss by at least 30 %."""
    run = assert_ok(train([], config="gpt_tiny_gdn.yaml", metrics=tmp_path / "m.jsonl"))
    first, last = run.losses[0], run.losses[-1]
    assert len(run.losses) == 60
    assert last <= 0.7 * first, (first, last)
    print(f"gpt_tiny_gdn: loss {first:.2f} -> {last:.2f} in 60 steps", file=sys.stderr)
    assert "mcore-npu train: done steps=60" in run.stdout
