"""Multi-latent attention in the YAML schema: ``model.multi_latent_attention: true`` builds an
``MLATransformerConfig`` from the MLA fields; configs/gpt_tiny_mla.yaml and
configs/ascend_moonlight_16b.yaml; what is refused before any process starts."""

from __future__ import annotations

import pytest

from mcore_npu.training.config import ConfigError, load_config
from tests.launch import CONFIGS

MLA = CONFIGS / "gpt_tiny_mla.yaml"
MOONLIGHT = CONFIGS / "ascend_moonlight_16b.yaml"


def test_the_tiny_mla_config_builds_deepseek_v3s_shape():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from mcore_npu.training.model import transformer_config

    config = transformer_config(load_config(MLA))
    assert type(config) is MLATransformerConfig and config.multi_latent_attention
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_head_dim,
            config.qk_pos_emb_head_dim, config.v_head_dim) == (64, 32, 32, 16, 32)  # fmt: skip
    assert (config.rope_type, config.rotary_scaling_factor, config.rotary_base) == (
        "yarn", 4.0, 10000.0)  # fmt: skip
    assert config.num_query_groups == config.num_attention_heads == 4
    assert config.moe_layer_freq == [0, 1] and config.moe_router_score_function == "sigmoid"
    assert (config.moe_router_num_groups, config.moe_router_group_topk,
            config.moe_router_topk) == (2, 1, 2)  # fmt: skip
    assert config.moe_router_enable_expert_bias and config.moe_grouped_gemm


def test_the_moonlight_config_validates_for_its_node_only():
    from mcore_npu.training.model import transformer_config

    cfg = load_config(MOONLIGHT, world_size=8)  # TP 1 x PP 4 x CP 2, EP 2 over the CP ranks
    config = transformer_config(cfg)
    assert config.q_lora_rank is None and config.kv_lora_rank == 512  # null kept: linear_q_proj
    assert (config.num_layers, config.hidden_size, config.num_moe_experts) == (27, 2048, 64)
    assert (config.num_layers_in_first_pipeline_stage,
            config.num_layers_in_last_pipeline_stage) == (7, 6)  # fmt: skip
    assert (config.context_parallel_size, config.expert_model_parallel_size) == (2, 2)
    assert config.rotary_base == 50000.0 and config.rope_type == "rope"
    assert config.moe_layer_freq == [0] + [1] * 26
    assert config.recompute_granularity == "full" and config.bf16
    with pytest.raises(ConfigError, match="parallel.tensor"):  # 8 ranks of model parallelism
        load_config(MOONLIGHT, world_size=4)
    with pytest.raises(ConfigError, match="parallel.expert"):  # data x context = 2 ranks
        load_config(MOONLIGHT, ["parallel.expert=4"], world_size=8)


BAD = [
    (["model.q_lora_rank=16"], "gpt_tiny.yaml", "model.q_lora_rank"),  # MLA field without MLA
    (["model.num_query_groups=2"], "gpt_tiny_mla.yaml", "model.num_query_groups"),
    (["attention.backend=local"], "gpt_tiny_mla.yaml", "model.multi_latent_attention"),
    (["model.position_embedding_type=learned_absolute"], "gpt_tiny_mla.yaml",
     "model.position_embedding_type"),
    (["model.kv_lora_rank=null"], "gpt_tiny_mla.yaml", "model.kv_lora_rank"),  # only q may be null
]  # fmt: skip


@pytest.mark.parametrize("overrides, config, key", BAD, ids=[b[2] for b in BAD])
def test_mla_configs_that_cannot_work_are_refused_naming_the_key(overrides, config, key):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / config, overrides)
    assert str(info.value).startswith(f"config {key}"), str(info.value)
