"""A DeepSeek-V3 checkpoint through mbridge 0.15.1's ``deepseek_v3`` bridge and the plugin's verl
engine into a valid ``MLATransformerConfig`` (transformers 5, megatron-core 0.16.1, real verl).

verl's own ``_build_tf_config`` fails for it before any plugin code runs: mbridge reads
``hf_config.rope_theta`` (transformers 5 keeps it in ``rope_parameters``) and passes
``max_position_embeddings``, which ``MLATransformerConfig`` rejects; mbridge also drops yarn and
the group-limited routing of a transformers 5 config. The plugin's engine builds the bridge
itself (``mcore_npu.integrations.mbridge_fixes``, ``integrations/verl/tf_config.py``); these
tests check the config it gets, that mbridge and verl stay unpatched, the refusals, and that the
plugin's copy of verl's steps builds what verl builds where verl can (a Qwen2 model).

The checkpoint is ``tiny_deepseek_v3_model`` (tests/integrations/conftest.py). No model is built
here (only configs); tests/integrations/test_deepseek_model.py builds it, loads it and compares
it with transformers. Last, configs/ascend_moonlight_16b.yaml against the config the bridge
builds from Moonlight-16B-A3B's config.json.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect

import pytest
import torch

pytest.importorskip("verl")

from megatron.core.transformer.transformer_config import MLATransformerConfig
from verl.workers.engine.megatron import MegatronEngineWithLMHead
from verl.workers.engine_workers import TrainingWorker

from mcore_npu.integrations.verl.engine import NPUMegatronEngineWithLMHead
from tests.integrations.conftest import tiny_deepseek_v3_config, training_worker_config

pytestmark = pytest.mark.usefixtures("cpu_runtime")

WANT = dict(  # the MLATransformerConfig fields the tiny checkpoint must give
    num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
    q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16,
    rope_type="yarn", rotary_base=10000.0, rotary_scaling_factor=4.0,
    original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0,
    beta_slow=1.0,
    num_moe_experts=8, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
    moe_layer_freq=[0, 1], moe_router_topk=2, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32", mtp_num_layers=None,
    bf16=True, fp16=False,
)  # fmt: skip


def _engine(path, *, npu: bool = True, **model_config):
    """A TrainingWorker's engine (the plugin's with ``npu``, else verl's own), not built."""
    with pytest.MonkeyPatch.context() as env:
        if npu:
            env.setenv("VERL_ENGINE_DEVICE", "npu")
            env.setenv("VERL_ENGINE_VENDOR", "huawei")
        config = training_worker_config(str(path))
        if model_config:  # verl's configs are frozen: replaced, not set
            fields = dataclasses.replace(config.model_config, **model_config)
            config = dataclasses.replace(config, model_config=fields)
        engine = TrainingWorker(config).engine
    assert type(engine) is (NPUMegatronEngineWithLMHead if npu else MegatronEngineWithLMHead)
    return engine


def test_the_plugin_engine_builds_the_mla_config(tiny_deepseek_v3_model):
    from mbridge.core.llm_bridge import LLMBridge
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    engine = _engine(tiny_deepseek_v3_model)
    engine._build_tf_config()
    config = engine.tf_config
    assert type(config) is MLATransformerConfig
    assert {key: getattr(config, key) for key in WANT} == WANT
    bridge = engine.bridge
    assert isinstance(bridge, DeepseekV3Bridge) and bridge.config is config
    assert bridge.hf_config is engine.model_config.hf_config
    assert "_get_transformer_layer_spec" in vars(bridge)  # the NPU spec, on this bridge only
    # mbridge unpatched: its class builds its config as before
    assert DeepseekV3Bridge.TransformerConfigClass is MLATransformerConfig
    assert DeepseekV3Bridge._build_base_config is LLMBridge._build_base_config
    assert "_get_transformer_layer_spec" not in vars(DeepseekV3Bridge)


def test_verls_own_engine_fails_for_both_causes(tiny_deepseek_v3_model):
    """What the plugin's engine gets through: verl's engine stops at ``rope_theta``, and with
    ``rope_theta`` given, at ``max_position_embeddings``."""
    engine = _engine(tiny_deepseek_v3_model, npu=False)
    with pytest.raises(AttributeError, match="rope_theta"):
        engine._build_tf_config()
    engine.model_config.hf_config.rope_theta = 10000.0
    with pytest.raises(TypeError, match="max_position_embeddings"):
        engine._build_tf_config()


def _bridge(**overrides):
    from mcore_npu.integrations.hf import bridge_from_config

    return bridge_from_config(tiny_deepseek_v3_config(**overrides), dtype=torch.float32)


def test_explicit_overrides_win_and_plain_rope_stays_rope():
    bridge = _bridge(rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    assert (bridge.config.rope_type, bridge.config.rotary_base) == ("rope", 5000.0)
    assert bridge.config.rotary_scaling_factor == 1  # mbridge's default: no yarn values given
    bridge.set_extra_args(moe_router_group_topk=2)
    assert bridge.config.moe_router_group_topk == 2


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(n_group=4, topk_group=2, num_experts_per_tok=2), "topk_group"),  # 2 // 2 != 2
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
         "rope_type"),
    ],
)  # fmt: skip
def test_routings_and_rope_megatron_cannot_compute_are_refused(overrides, key):
    with pytest.raises(ValueError, match=key):
        _bridge(**overrides)


def test_multi_token_prediction_is_refused_before_a_model_exists(tmp_path):
    """With verl's ``mtp.enable`` and a checkpoint with an MTP layer, mbridge would build TE's
    MTP layers: the engine refuses, naming the key and the switch."""
    config = tiny_deepseek_v3_config(num_nextn_predict_layers=1)
    config.architectures = ["DeepseekV3ForCausalLM"]  # verl reads it; a config alone has none
    config.save_pretrained(tmp_path)  # _build_tf_config needs no weights
    from verl.workers.config.model import MtpConfig

    engine = _engine(tmp_path, mtp=MtpConfig(enable=True))
    with pytest.raises(ValueError, match="mtp_num_layers: 1.*mtp.enable=False"):
        engine._build_tf_config()


def test_the_plugins_copy_of_verls_steps_builds_what_verl_builds(tiny_hf_model):
    """``build_mbridge_tf_config`` against verl's own ``_build_tf_config`` on a model verl can
    build (Qwen2): the same config, field by field, and the same engine attributes. And the verl
    method it copies is the one installed (its source hash)."""
    from mbridge import AutoBridge

    from mcore_npu.integrations.verl.tf_config import VERL_SOURCE_SHA256, build_mbridge_tf_config

    source = inspect.getsource(MegatronEngineWithLMHead._build_tf_config)
    assert hashlib.sha256(source.encode()).hexdigest() == VERL_SOURCE_SHA256, (
        "verl's MegatronEngine._build_tf_config changed: read it again, update "
        "mcore_npu/integrations/verl/tf_config.py and its VERL_SOURCE_SHA256"
    )
    theirs, ours = _engine(tiny_hf_model, npu=False), _engine(tiny_hf_model, npu=False)
    theirs._build_tf_config()
    build_mbridge_tf_config(ours, AutoBridge.from_config)
    for field in dataclasses.fields(theirs.tf_config):
        want, got = getattr(theirs.tf_config, field.name), getattr(ours.tf_config, field.name)
        if callable(want) and not isinstance(want, type):  # init functions: made per config
            want, got = (
                getattr(want, "__qualname__", repr(want)),
                getattr(got, "__qualname__", repr(got)),
            )
        assert got == want, field.name
    for name in ("is_value_model", "share_embeddings_and_output_weights", "param_dtype", "dtype",
                 "provider", "vanilla_bridge", "peft_cls"):  # fmt: skip
        assert getattr(ours, name) == getattr(theirs, name), name
    assert type(ours.bridge) is type(theirs.bridge)


def test_the_tiny_checkpoint_reloads_in_transformers(tiny_deepseek_v3_model):
    """The fixture the logits comparison will use: transformers reads it back with its yarn
    RoPE and the drawn expert bias, and its forward runs."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(tiny_deepseek_v3_model).eval()
    assert model.config.rope_parameters["rope_type"] == "yarn"
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"  # the dense first layer
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.shape == (8,) and bias.abs().min() > 0
    with torch.no_grad():
        logits = model(input_ids=torch.arange(12).view(1, 12)).logits
    assert logits.shape == (1, 12, 128) and logits.isfinite().all()


# moonshotai/Moonlight-16B-A3B config.json, its model fields (no rope_scaling: plain RoPE)
MOONLIGHT = dict(
    vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
    num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
    q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
    routed_scaling_factor=2.446, norm_topk_prob=True, scoring_func="sigmoid",
    topk_method="noaux_tc", rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=8192,
    tie_word_embeddings=False, aux_loss_alpha=0.001, num_nextn_predict_layers=0,
)  # fmt: skip
# MLATransformerConfig fields that are the run's, not the model's: the parallel layout, where
# weights are initialised, CUDA fusions and flags, recompute; kv_channels, which MLA never reads
# (mbridge writes transformers' head_dim = qk_rope_head_dim into it)
RUN_FIELDS = {
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "expert_model_parallel_size", "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage", "cp_comm_type", "microbatch_group_size_per_vp_stage",
    "use_cpu_initialization", "variable_seq_lengths", "attention_backend", "mtp_num_layers",
    "disable_bf16_reduced_precision_matmul", "bias_activation_fusion", "masked_softmax_fusion",
    "persist_layer_norm", "bias_dropout_fusion", "recompute_granularity", "recompute_method",
    "recompute_num_layers", "kv_channels",
}  # fmt: skip


def test_the_moonlight_config_is_the_model_mbridge_builds_from_its_checkpoint():
    """configs/ascend_moonlight_16b.yaml's MLATransformerConfig equals, field for field, the one
    the plugin's deepseek_v3 bridge builds from Moonlight-16B-A3B's config.json, except the
    run's own fields (parallel layout, fusions, recompute)."""
    from transformers import DeepseekV3Config

    from mcore_npu.training.config import load_config
    from mcore_npu.training.model import transformer_config
    from tests.launch import CONFIGS

    bridge = _bridge_of(DeepseekV3Config(**MOONLIGHT))
    ours = transformer_config(load_config(CONFIGS / "ascend_moonlight_16b.yaml", world_size=8))
    assert type(ours) is type(bridge.config) is MLATransformerConfig
    differ = set()
    for field in dataclasses.fields(MLATransformerConfig):
        want, got = getattr(bridge.config, field.name), getattr(ours, field.name)
        if callable(want) and not isinstance(want, type):  # init / activation functions
            want, got = _callable_key(want), _callable_key(got)
        if want != got:
            differ.add(field.name)
    assert differ <= RUN_FIELDS, {name: (getattr(bridge.config, name), getattr(ours, name))
                                  for name in differ - RUN_FIELDS}  # fmt: skip
    assert (ours.context_parallel_size, ours.expert_model_parallel_size,
            ours.pipeline_model_parallel_size) == (2, 2, 4)  # fmt: skip


def _callable_key(function):
    """A function by name, a ``functools.partial`` (Megatron's init methods) by name and
    arguments; made per config, so compared by what they compute."""
    inner = getattr(function, "func", function)
    return (getattr(inner, "__qualname__", repr(inner)), getattr(function, "args", ()),
            tuple(sorted(getattr(function, "keywords", {}).items())))  # fmt: skip


def _bridge_of(hf_config):
    from mcore_npu.integrations.hf import bridge_from_config

    return bridge_from_config(hf_config, dtype=torch.bfloat16)
