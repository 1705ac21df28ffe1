"""GLM-5 (``glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``) configs through the plugin's DSA
bridge (``mcore_npu.integrations.hf_dsa``) into ``DSATransformerConfig``: the DeepSeek-V3 fields,
the DSA fields, the spec keywords per model, the weight-name map, and the refusals. No model is
built here (test_dsa_models.py builds, loads and compares them with transformers 5.25).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("mbridge")
pytest.importorskip("transformers.models.glm_moe_dsa")
pytest.importorskip("transformers.models.deepseek_v32")

from tests.dsa_hf.dsa_models import MODEL_TYPES, TOPK, save_tiny, tiny_config

pytestmark = pytest.mark.usefixtures("cpu_runtime")

WANT = dict(  # the DSATransformerConfig (MLA) fields both tiny checkpoints give
    num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
    q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
    num_moe_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
    moe_layer_freq=[0, 1, 1], moe_router_topk=2, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5, qk_layernorm=True, multi_latent_attention=True,
    experimental_attention_variant="dsa", dsa_indexer_n_heads=8, dsa_indexer_head_dim=32,
    dsa_indexer_topk=TOPK, dsa_indexer_loss_coeff=0.0, mtp_num_layers=None,
)  # fmt: skip
PER_MODEL = {
    "glm_moe_dsa": dict(layernorm_epsilon=1e-5, rope_type="rope", rotary_scaling_factor=1.0),
    "deepseek_v32": dict(layernorm_epsilon=1e-6, rope_type="yarn", rotary_scaling_factor=4.0,
                         original_max_position_embeddings=32),
}  # fmt: skip
SHARED = dict(
    mla_latent_norm_epsilon=1e-6,  # as transformers builds them, any rms_norm_eps
    dsa_indexer_topk_freq=1,
    dsa_indexer_skip_topk_offset=0,
)  # every layer indexes
SPEC = {
    "glm_moe_dsa": dict(dsa_indexer_rope_interleaved=True, dsa_indexer_k_norm_epsilon=1e-6,
                        **SHARED),
    "deepseek_v32": dict(dsa_indexer_rope_interleaved=False, dsa_indexer_k_norm_epsilon=1e-6,
                         **SHARED),
}  # fmt: skip
ATTENTION = {  # Megatron name after decoder.layers.{i}. -> Hugging Face after model.layers.{i}.
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.core_attention.indexer.linear_wq_b.weight": "self_attn.indexer.wq_b.weight",
    "self_attention.core_attention.indexer.linear_wk.weight": "self_attn.indexer.wk.weight",
    "self_attention.core_attention.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "self_attention.core_attention.indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "self_attention.core_attention.indexer.linear_weights_proj.weight":
        "self_attn.indexer.weights_proj.weight",
}  # fmt: skip
DENSE = {
    "mlp.linear_fc1.layer_norm_weight": ["post_attention_layernorm.weight"],
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
}
MOE = {
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    "mlp.router.weight": ["mlp.gate.weight"],
    "mlp.router.expert_bias": ["mlp.gate.e_score_correction_bias"],
    "mlp.shared_experts.linear_fc1.weight": ["mlp.shared_experts.gate_proj.weight",
                                             "mlp.shared_experts.up_proj.weight"],
    "mlp.shared_experts.linear_fc2.weight": ["mlp.shared_experts.down_proj.weight"],
    **{f"mlp.experts.linear_fc1.weight{e}": [f"mlp.experts.{e}.gate_proj.weight",
                                             f"mlp.experts.{e}.up_proj.weight"] for e in range(4)},
    **{f"mlp.experts.linear_fc2.weight{e}": [f"mlp.experts.{e}.down_proj.weight"]
       for e in range(4)},
}  # fmt: skip


def megatron_names() -> dict[str, list[str]]:
    """Every Megatron (TE layout) name of the tiny DSA model -> its Hugging Face names, as the
    plugin's DSA layer (dense first layer, then MoE) holds them."""
    names = {
        "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": ["model.norm.weight"],
        "output_layer.weight": ["lm_head.weight"],
    }
    for layer, mlp in enumerate((DENSE, MOE, MOE)):
        for ours, theirs in {**{k: [v] for k, v in ATTENTION.items()}, **mlp}.items():
            names[f"decoder.layers.{layer}.{ours}"] = [f"model.layers.{layer}.{t}" for t in theirs]
    return names


def _bridge(model_type, **overrides):
    from mcore_npu.integrations.hf import bridge_from_config

    return bridge_from_config(tiny_config(model_type, **overrides), dtype=torch.float32)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_dsa_bridge_builds_the_mla_config_with_the_dsa_fields(model_type):
    from mbridge import AutoBridge
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    from mcore_npu.integrations.hf_dsa import DSABridge, dsa_spec_keywords
    from mcore_npu.transformer.dsa import DSATransformerConfig

    bridge = _bridge(model_type)
    assert type(bridge) is DSABridge and isinstance(bridge, DeepseekV3Bridge)
    assert AutoBridge.list_supported_models().count(model_type) == 1
    assert bridge.own_npu_spec
    config = bridge.config
    assert type(config) is DSATransformerConfig  # MLA's config, admitting context parallelism
    want = {**WANT, **PER_MODEL[model_type]}
    assert {key: getattr(config, key) for key in want} == want
    assert dsa_spec_keywords(bridge.hf_config) == SPEC[model_type]


def test_mlp_layer_types_decide_the_moe_layers():
    """``mlp_layer_types`` (transformers' per-layer form) wins over ``first_k_dense_replace``."""
    bridge = _bridge("glm_moe_dsa", mlp_layer_types=["sparse", "dense", "sparse"])
    assert bridge.config.moe_layer_freq == [1, 0, 1]
    assert _bridge("glm_moe_dsa", first_k_dense_replace=2).config.moe_layer_freq == [0, 0, 1]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_the_weight_map_covers_the_checkpoint_one_to_one(model_type, tmp_path):
    """Every Megatron name maps to the Hugging Face names above, and together they are exactly
    the tensors transformers saves (nothing left over, nothing twice)."""
    import safetensors.torch

    save_tiny(model_type, tmp_path)
    saved = safetensors.torch.load_file(str(next(tmp_path.glob("*.safetensors"))))
    bridge = _bridge(model_type)
    names = megatron_names()
    for ours, theirs in names.items():
        assert bridge._weight_name_mapping_mcore_to_hf(ours) == theirs, ours
    mapped = [name for theirs in names.values() for name in theirs]
    assert len(mapped) == len(set(mapped))  # each once
    assert set(mapped) == set(saved)
    with pytest.raises(ValueError, match="no Hugging Face tensor"):
        bridge._weight_name_mapping_mcore_to_hf("decoder.layers.0.self_attention.linear_qkv.weight")


REFUSED = [
    # top-k sharing Megatron's rule cannot write (the first layer has no earlier one)
    ("glm_moe_dsa", dict(indexer_types=["shared", "full", "full"]), "indexer_types"),
    ("glm_moe_dsa", dict(indexer_types=["full", "sparse", "full"]), "indexer_types"),
    ("glm_moe_dsa", dict(attention_bias=True), "attention_bias"),
    ("deepseek_v32", dict(hidden_act="gelu"), "hidden_act"),
    ("deepseek_v32", dict(num_key_value_heads=2), "num_key_value_heads"),
    ("deepseek_v32", dict(norm_topk_prob=False), "norm_topk_prob"),  # the DeepSeek-V3 checks
    ("glm_moe_dsa", dict(n_group=2, topk_group=1, num_experts_per_tok=1), "topk_group"),
]


@pytest.mark.parametrize(("model_type", "overrides", "field"), REFUSED)
def test_what_the_plugin_does_not_build_is_refused_naming_the_field(model_type, overrides, field):
    with pytest.raises(ValueError, match=field):
        _bridge(model_type, **overrides)


@pytest.mark.parametrize(
    ("field", "value"),
    [("q_lora_rank", None),  # DeepSeek-V2-Lite's form; the indexer reads the query latent
     ("mlp_layer_types", ["dense", "moe", "sparse"]),
     ("mlp_layer_types", ["dense", "sparse"])],
)  # fmt: skip
def test_fields_transformers_would_not_take_are_refused_too(field, value):
    """Configs transformers' own validation refuses (``q_lora_rank`` is typed int,
    ``mlp_layer_types`` checked), set past its checks as a hand-edited config would be."""
    from mcore_npu.integrations.hf import bridge_from_config

    config = tiny_config("deepseek_v32")
    object.__setattr__(config, field, value)  # past the strict dataclass's own check
    with pytest.raises(ValueError, match=field):
        bridge_from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_multi_token_prediction_layers_come_from_the_npu_spec(model_type):
    """A checkpoint with ``num_nextn_predict_layers`` (GLM-5 and DeepSeek-V3.2 have 1): the
    config asks for one MTP layer, built from the NPU spec (a DSA layer, no Transformer Engine;
    test_dsa_mtp.py checks its weights and logits); MTP can still be turned off."""
    from mcore_npu.integrations.hf import build_model
    from mcore_npu.transformer.dsa import NPUDSASelfAttention
    from tests.hf_model_checks import CPU_ARGS, own_attention_variables

    bridge = _bridge(model_type, num_nextn_predict_layers=1)
    assert bridge.config.mtp_num_layers == 1
    bridge.set_extra_args(**CPU_ARGS)
    with own_attention_variables():  # the DeepSeek family's attention_backend: fused
        (mtp,) = build_model(bridge).mtp.layers
        assert isinstance(mtp.transformer_layer.self_attention, NPUDSASelfAttention)
        bridge.set_extra_args(mtp_num_layers=None)
        assert bridge.config.mtp_num_layers is None
        assert not hasattr(build_model(bridge), "mtp")
