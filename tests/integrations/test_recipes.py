"""verl's Ascend recipes, as written, through the plugin's engine (the census).

One case per key set of ``tests/integrations/ascend_recipes.yaml`` (verl's public Ascend recipes of
the Qwen2.5 dense, Qwen3 dense and Qwen3-MoE families, each key set verbatim with its source
file) and per layout the recipe uses (thd: ``use_remove_padding=True``; bshd: False):

- verl's ``TrainingWorker`` picks the plugin's engine (``VERL_ENGINE_DEVICE=npu``,
  ``VERL_ENGINE_VENDOR=huawei``) and builds the model with the recipe's
  ``override_transformer_config`` unchanged; shell variables are replaced by the YAML's
  ``scaled`` values (one CPU process: every parallel size is 1);
- a tiny model of the recipe's family (transformers' Qwen2 / Qwen3 / Qwen3-MoE, random weights);
- one forward and backward through verl's ``forward_backward_batch``; the engine's log-probs
  equal transformers' within 1e-4 on the same weights in fp32 (the engine's GPTModel is cast to
  fp32 after the bridge loads the weights in bf16, and transformers gets the same bf16-rounded
  weights in fp32; see test_engine_moe.py), every gradient is finite and most are non-zero.

As in test_engine.py only the model is needed: ``_build_tf_config`` and
``_build_megatron_module`` are the steps ``engine.initialize()`` runs first. Keys that switch a
fused path (``apply_rope_fusion`` -> ``rope_kernel``, ``moe_permute_fusion`` ->
``moe_permute_kernel``) reach the spec, and the built layers hold the fused modules
(``NPURotarySelfAttention``, ``NPUMoELayer``) exactly when asked.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

import transformers
import yaml
from megatron.core.transformer.enums import AttnBackend
from verl.workers.engine_workers import TrainingWorker

from mcore_npu.integrations.verl.engine import (
    NPUMegatronEngineWithLMHead,
    NPUMegatronEngineWithValueHead,
)
from mcore_npu.transformer.rope import NPURotarySelfAttention
from mcore_npu.transformer.token_permute import NPUMoELayer
from tests.integrations.conftest import (
    VOCAB,
    _save_word_level_tokenizer,
    engine_model,
    training_worker_config,
)
from tests.integrations.log_probs import hf_log_probs, mean_negative_log_prob, packed_batch

pytestmark = pytest.mark.usefixtures("cpu_runtime")

RECIPES = yaml.safe_load((Path(__file__).parent / "ascend_recipes.yaml").read_text())["recipes"]
CASES = [(recipe["name"], layout) for recipe in RECIPES for layout in recipe["layouts"]]
BY_NAME = {recipe["name"]: recipe for recipe in RECIPES}
LENGTHS = (11, 7, 4)
# the recipe keys that switch a fused operator, and the NPU spec keyword each one sets
FUSED_SWITCHES = {
    "use_fused_rmsnorm": "rms_norm_kernel",
    "use_fused_swiglu": "swiglu_kernel",
    "apply_rope_fusion": "rope_kernel",
    "use_fused_rotary_pos_emb": "rope_kernel",
    "moe_permute_fusion": "moe_permute_kernel",
}

SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
             tie_word_embeddings=False, hidden_act="silu", initializer_range=0.2)  # fmt: skip
FAMILIES = {
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, intermediate_size=128),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, intermediate_size=128, head_dim=16),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, head_dim=16, norm_topk_prob=True,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(family) -> path``: one tiny checkpoint (and tokenizer) per family, made once."""
    made: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in made:
            path = tmp_path_factory.mktemp(family)
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]())
            with torch.no_grad():  # norms away from 1, so a dropped one shows
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.add_(torch.randn_like(p) * 0.2)
            model.save_pretrained(path, safe_serialization=True)
            _save_word_level_tokenizer(path)
            made[family] = str(path)
        return made[family]

    return get


def scaled_keys(recipe: dict) -> dict:
    """The recipe's keys with each ``${var}`` replaced by ``recipe["scaled"][var]``."""
    scale = recipe.get("scaled", {})
    out = {}
    for key, value in recipe["keys"].items():
        match = re.fullmatch(r"\$\{(\w+)\}", value) if isinstance(value, str) else None
        out[key] = scale[match.group(1)] if match else value
    return out


def _worker_engine(path: str, keys: dict, *, thd: bool, model_type: str = "language_model"):
    """``(engine, the worker's engine config)``: verl's TrainingWorker picks the plugin's engine."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VERL_ENGINE_DEVICE", "npu")
        env.setenv("VERL_ENGINE_VENDOR", "huawei")
        config = training_worker_config(path, remove_padding=thd, override_transformer_config=keys)
        if model_type != "language_model":
            config = dataclasses.replace(config, model_type=model_type)
        worker = TrainingWorker(config)
    return worker.engine, worker.config.engine_config


def _build(path: str, keys: dict, *, thd: bool, model_type: str = "language_model"):
    """``(engine with its model built, a copy of the worker's overrides after the build)``."""
    engine, worker_engine_config = _worker_engine(path, keys, thd=thd, model_type=model_type)
    engine._build_tf_config()  # the first two steps of engine.initialize()
    engine.module = engine._build_megatron_module()
    return engine, copy.deepcopy(dict(worker_engine_config.override_transformer_config))


@pytest.mark.parametrize(("name", "layout"), CASES)
def test_recipe_runs_unchanged_and_matches_transformers(name, layout, checkpoint):
    recipe = BY_NAME[name]
    keys = scaled_keys(recipe)
    path = checkpoint(recipe["family"])
    engine, user = _build(path, keys, thd=layout == "thd")
    assert type(engine) is NPUMegatronEngineWithLMHead
    assert user == keys  # the worker's config object still holds the recipe as written
    assert set(engine.engine_config.override_transformer_config) <= set(
        vars(engine.tf_config)
    )  # verl got Megatron fields only
    want_spec = {FUSED_SWITCHES[k]: None if v else "off" for k, v in keys.items()
                 if k in FUSED_SWITCHES}  # fmt: skip
    assert engine.recipe_plan.spec == want_spec
    assert engine.npu_spec_keywords == want_spec
    layers = engine_model(engine).decoder.layers
    rope = want_spec.get("rope_kernel", "off") != "off"
    assert {type(layer.self_attention) is NPURotarySelfAttention for layer in layers} == {rope}
    if recipe["family"] == "qwen3_moe":
        permute = want_spec.get("moe_permute_kernel", "off") != "off"
        assert {type(layer.mlp) is NPUMoELayer for layer in layers} == {permute}
    norms = {
        layer.self_attention.linear_qkv.norm_kernel for layer in engine_model(engine).decoder.layers
    }
    assert norms == {"auto"}  # no census recipe turns it off: npu_rms_norm, the spec's kernel
    for key in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        if key in keys:
            assert getattr(engine.tf_config, key) == keys[key]
    engine_model(engine).float()  # the bf16-loaded weights, computed in fp32

    data, _ = packed_batch(LENGTHS)
    result = engine.forward_backward_batch(data, mean_negative_log_prob)
    rows = result["model_output"]["log_probs"].unbind()
    got = [row[: n - 1].float() for row, n in zip(rows, LENGTHS, strict=True)]
    want = hf_log_probs(path, LENGTHS)
    error = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    assert error < 1e-4, f"{name} ({layout}): max |log p - log p_hf| = {error:.2e}"
    grads = [_grad(p) for p in engine.module[0].parameters()]
    assert all(torch.isfinite(g).all() for g in grads)
    assert sum(bool(g.abs().sum() > 0) for g in grads) > len(grads) // 2


def _grad(param) -> torch.Tensor:
    """The gradient of one parameter after the backward.

    Megatron's DDP adds it into ``main_grad`` through a hook on the parameter's gradient
    accumulator; the fp32 cast (``.float()`` after the bridge's bf16 load) gives the parameter a
    new accumulator, so the gradient stays in ``param.grad``. Either place counts.
    """
    extra = param.grad if param.grad is not None else 0
    return param.main_grad.float() + extra


def test_value_engine_applies_the_recipe_and_leaves_the_users_config_alone(checkpoint, caplog):
    """The critic's value-model engine: the same translation; the worker's config unchanged."""
    keys = {"use_flash_attn": True, "use_fused_rmsnorm": False, "use_distributed_optimizer": False,
            "gradient_accumulation_fusion": True, "context_parallel_algo": "kvallgather_cp_algo",
            "multi_head_latent_attention": False, "attention_backend": "flash"}  # fmt: skip
    engine, worker_config = _worker_engine(
        checkpoint("qwen3"), keys, thd=True, model_type="value_model"
    )
    assert type(engine) is NPUMegatronEngineWithValueHead
    with caplog.at_level(logging.INFO, logger="mcore_npu.integrations.verl.recipe"):
        engine._build_tf_config()
    engine.module = engine._build_megatron_module()
    assert engine.npu_spec_keywords == {"rms_norm_kernel": "off"}
    layers = engine_model(
        engine
    ).decoder.layers  # the switch reached the built model: torch's RMSNorm
    assert [layer.self_attention.linear_qkv.norm_kernel for layer in layers] == [None, None]
    assert engine.tf_config.gradient_accumulation_fusion is False
    assert engine.tf_config.cp_comm_type == "all_gather"
    assert engine.tf_config.multi_latent_attention is False
    assert engine.tf_config.attention_backend is AttnBackend.auto  # Megatron's default kept
    assert engine.engine_config.use_distributed_optimizer is False  # where verl reads it
    assert worker_config.use_distributed_optimizer is True  # the user's object: as it was
    assert dict(worker_config.override_transformer_config) == keys
    cost = [
        r.getMessage() for r in caplog.records if "gradient_accumulation_fusion" in r.getMessage()
    ]
    assert len(cost) == 1 and "once per linear layer per micro-batch" in cost[0], cost


@pytest.mark.parametrize(
    ("keys", "fragments"),
    [
        ({"use_flash_attn": True, "use_ascend_mc2": True}, ["use_ascend_mc2=true", "MC2"]),
        ({"context_parallel_size": 2}, ["context_parallel_size=2", "megatron.context_parallel_size is 1"]),
        ({"use_flash_atn": True}, ["did you mean 'use_flash_attn'"]),
        ({"context_parallel_algo": "hybrid_cp_algo"}, ["hybrid_cp_algo", "ulysses_cp_algo"]),
    ],
)  # fmt: skip
def test_refused_recipe_stops_before_any_bridge_or_model(keys, fragments, checkpoint):
    engine, _ = _worker_engine(checkpoint("qwen2"), keys, thd=False)
    with pytest.raises(ValueError) as info:
        engine._build_tf_config()
    message = str(info.value)
    assert "\n" not in message and "refused" in message
    assert all(fragment in message for fragment in fragments), message
    assert getattr(engine, "bridge", None) is None and getattr(engine, "module", None) is None
