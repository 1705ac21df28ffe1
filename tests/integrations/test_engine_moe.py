"""MoE checkpoints through the plugin's verl engine: the Hugging Face config fixes reach verl.

mbridge 0.15.1 hard-codes the router's softmax form per family (``moe_router_pre_softmax``:
True for Mixtral, False for Qwen3-MoE); the Hugging Face router renormalises the top-k weights
for Mixtral always and for Qwen3-MoE only with ``norm_topk_prob``, so both tiny models below
need the other form. transformers 5 also leaves Mixtral's ``head_dim`` None, which mbridge
multiplies when it merges q/k/v. The engine applies ``mcore_npu.integrations.hf``'s fixes
(``_NPUEngineMixin._match_hf_config``); these tests build the engine as
``tests/integrations/test_engine.py`` does (verl's ``TrainingWorker`` picks it; its
``_build_tf_config`` and ``_build_megatron_module``) and compare its log-probs with transformers.

Precision: verl's ``McoreEngineConfig`` accepts only bf16 / fp16, so the bridge loads the weights
in bf16. The tests then cast the built GPTModel to fp32 and give the transformers model the same
bf16-rounded weights in fp32: both sides compute in fp32 from identical weights, so 1e-4 holds.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

import transformers
from verl.workers.engine_workers import TrainingWorker

from mcore_npu.integrations.verl.engine import NPUMegatronEngineWithLMHead
from tests.integrations.conftest import VOCAB, engine_model, training_worker_config
from tests.integrations.log_probs import hf_log_probs, packed_batch

pytestmark = pytest.mark.usefixtures("cpu_runtime")

LENGTHS = (12, 7, 5)
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
             tie_word_embeddings=False, hidden_act="silu", num_experts_per_tok=2)  # fmt: skip
FAMILIES = {  # 4 experts of width 32, top-2, softmax router; mbridge's hard-coded pre_softmax
    "mixtral": (
        lambda: transformers.MixtralConfig(**SHAPE, intermediate_size=32, num_local_experts=4),
        True,
    ),
    "qwen3_moe_unnormalised": (
        lambda: transformers.Qwen3MoeConfig(
            **SHAPE,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            head_dim=16,
            norm_topk_prob=False,
        ),
        False,
    ),
}


def _checkpoint(family: str, path) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family][0]())
    with torch.no_grad():  # norms away from 1, so a dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True)


def _build_engine(path, *, override=None, build_model: bool = True):
    """verl's TrainingWorker engine (the plugin's) after ``_build_tf_config`` (and the model)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VERL_ENGINE_DEVICE", "npu")
        env.setenv("VERL_ENGINE_VENDOR", "huawei")
        config = training_worker_config(str(path), override_transformer_config=override)
        engine = TrainingWorker(config).engine
    assert type(engine) is NPUMegatronEngineWithLMHead
    engine._build_tf_config()
    if build_model:
        engine.module = engine._build_megatron_module()
    return engine


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe(request, tmp_path_factory, cpu_runtime):
    """``(family, checkpoint path, engine with its model cast to fp32)``."""
    path = tmp_path_factory.mktemp(request.param)
    _checkpoint(request.param, path)
    engine = _build_engine(path)
    engine_model(engine).float()  # the bf16-loaded weights, computed in fp32
    return request.param, path, engine


def _no_loss(model_output, data, dp_group=None):
    return torch.zeros(()), {}


def _engine_log_probs(engine) -> list[torch.Tensor]:
    """Per row ``[n - 1]`` fp32: log p(token t+1) from verl's forward (labels rolled by verl)."""
    data, _ = packed_batch(LENGTHS)
    result = engine.forward_backward_batch(data, _no_loss, forward_only=True)
    rows = result["model_output"]["log_probs"].unbind()
    return [row[: n - 1].float() for row, n in zip(rows, LENGTHS, strict=True)]


def _max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))


def test_engine_config_carries_the_hf_routing_and_head_dim(moe):
    family, _, engine = moe
    mbridge_form = FAMILIES[family][1]
    assert engine.tf_config is engine.bridge.config  # one object, as verl built it
    assert engine.tf_config.moe_router_pre_softmax is (not mbridge_form)
    assert engine.tf_config.bf16  # verl's own edits kept
    assert engine.bridge.hf_config.head_dim == 16
    routers = [layer.mlp.router for layer in engine_model(engine).decoder.layers]
    assert all(r.config.moe_router_pre_softmax is (not mbridge_form) for r in routers)


def test_engine_log_probs_match_transformers(moe):
    family, path, engine = moe
    error = _max_error(_engine_log_probs(engine), hf_log_probs(path, LENGTHS))
    assert error < 1e-4, f"{family}: max |log p - log p_hf| = {error:.2e}"


def test_mbridge_routing_form_would_miss(moe):
    """The same engine, its router switched back to mbridge's form: far outside 1e-4."""
    family, path, engine = moe
    want = hf_log_probs(path, LENGTHS)
    config = engine.tf_config
    fixed = config.moe_router_pre_softmax
    config.moe_router_pre_softmax = FAMILIES[family][1]
    try:
        error = _max_error(_engine_log_probs(engine), want)
    finally:
        config.moe_router_pre_softmax = fixed
    assert error > 1e-3, f"{family}: max |log p - log p_hf| = {error:.2e}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_override_transformer_config_wins(family, tmp_path):
    """``override_transformer_config={"moe_router_pre_softmax": ...}`` is kept as the user set it."""
    _checkpoint(family, tmp_path)
    mbridge_form = FAMILIES[family][1]
    override = {"moe_router_pre_softmax": mbridge_form}
    engine = _build_engine(tmp_path, override=override, build_model=False)
    assert engine.tf_config.moe_router_pre_softmax is mbridge_form
    assert engine.bridge.config is engine.tf_config
