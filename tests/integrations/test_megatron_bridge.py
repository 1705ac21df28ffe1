"""verl 0.9.1's default bridge, Megatron-Bridge (``vanilla_mbridge=False``), when it does not import.

No Megatron-Bridge release imports next to megatron-core 0.16.1 without Transformer Engine (the
verl page, docs/verl.md "Megatron-Bridge", has the versions and the failing import), so the verl
environment has none. What a user meets (``mcore_npu.integrations.verl.weight_path``): a model
family the plugin's Hugging Face path covers builds through mbridge (``test_weight_path.py``
checks that this gives mbridge's log-probs and exports exactly); any other family, and verl's
QAT, stops at the start of ``_build_tf_config`` with one ``ValueError`` line that names the
missing module and why the fallback cannot build it, instead of verl's
"pip install megatron-bridge" print and a bare ``ImportError`` from ``verl/models/mcore/bridge.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

pytest.importorskip("verl")

import transformers
from verl.workers.config import McoreEngineConfig, QATEngineConfig
from verl.workers.engine_workers import TrainingWorker

from mcore_npu.integrations.verl.engine import (
    NPUMegatronEngineWithLMHead,
    megatron_bridge_unavailable,
)
from mcore_npu.integrations.verl.weight_path import mbridge_fallback, uncovered_reason
from tests.integrations.conftest import VOCAB, tiny_deepseek_v3_config, training_worker_config

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def _phi3():
    """Phi-3's default ``pad_token_id`` (32000) lies outside the tiny vocabulary."""
    return transformers.Phi3Config(**TEXT, pad_token_id=0)


def _megatron_bridge_engine(model_path: str):
    """The plugin's engine from verl's TrainingWorker, configured with ``vanilla_mbridge=False``."""
    config = training_worker_config(model_path)
    engine_config = dataclasses.replace(config.engine_config, vanilla_mbridge=False)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VERL_ENGINE_DEVICE", "npu")
        env.setenv("VERL_ENGINE_VENDOR", "huawei")
        engine = TrainingWorker(dataclasses.replace(config, engine_config=engine_config)).engine
    assert type(engine) is NPUMegatronEngineWithLMHead
    return engine


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory) -> str:
    """A tiny Phi-3 checkpoint: a family neither mbridge nor the plugin has a bridge for."""
    path = tmp_path_factory.mktemp("tiny_phi3")
    transformers.AutoModelForCausalLM.from_config(_phi3()).save_pretrained(
        path, safe_serialization=True
    )
    return str(path)


def test_an_uncovered_family_stops_with_one_line(cpu_runtime, tiny_phi3, capsys):
    assert importlib.util.find_spec("megatron.bridge") is None  # none in the verl env
    engine = _megatron_bridge_engine(tiny_phi3)
    with pytest.raises(ValueError, match=r"vanilla_mbridge=False selects Megatron-Bridge") as info:
        engine._build_tf_config()
    message = str(info.value)
    assert "\n" not in message
    assert "megatron-bridge package is not installed" in message
    assert "model_type 'phi3' has no mbridge or plugin bridge" in message
    assert "qwen3_moe" in message and "deepseek_v3" in message  # the families that build
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert info.value.__cause__.name == "megatron.bridge"
    # stopped before verl's own import of megatron.bridge (which prints and re-raises)
    assert "Megatron-Bridge package not found" not in capsys.readouterr().out
    assert engine.engine_config.vanilla_mbridge is False  # nothing replaced


def test_covered_families_are_the_language_models_mbridge_or_the_plugin_bridge():
    covered = [transformers.Qwen2Config(**TEXT), transformers.Qwen3Config(**TEXT),
               transformers.Qwen3MoeConfig(**TEXT), transformers.MixtralConfig(**TEXT),
               transformers.LlamaConfig(**TEXT), tiny_deepseek_v3_config()]  # fmt: skip
    assert [uncovered_reason(config) for config in covered] == [None] * len(covered)
    vision = uncovered_reason(transformers.Qwen2_5_VLConfig())  # mbridge has a bridge for it
    assert "has a vision tower" in vision and "qwen2_5_vl" in vision
    assert "has no mbridge or plugin bridge" in uncovered_reason(_phi3())


def test_qat_needs_megatron_bridge_and_is_refused():
    """verl builds QAT through Megatron-Bridge only (and refuses it with mbridge itself)."""
    qwen3 = transformers.Qwen3Config(**TEXT)
    plain = McoreEngineConfig(dtype="bfloat16", vanilla_mbridge=False)
    assert mbridge_fallback(plain, qwen3) is True
    qat = dataclasses.replace(plain, qat=QATEngineConfig(enable=True))
    with pytest.raises(ValueError, match=r"qat.enable=True, and verl builds QAT through"):
        mbridge_fallback(qat, qwen3)
    chosen = McoreEngineConfig(dtype="bfloat16", vanilla_mbridge=True)
    assert mbridge_fallback(chosen, qwen3) is False  # mbridge as asked: no fallback


def test_the_reason_names_transformer_engine_when_megatron_bridge_needs_it():
    """A megatron-bridge installed with ``--no-deps`` fails on this import (0.3.1:
    ``megatron/bridge/peft/lora_layers.py``, line 20); the message says so."""
    with pytest.raises(ImportError) as missing:
        import transformer_engine.pytorch  # noqa: F401
    message = megatron_bridge_unavailable(missing.value, "model_type 'phi3' has no bridge")
    assert "imports transformer_engine" in message and "no Ascend build" in message
    assert "the mbridge fallback cannot build it: model_type 'phi3' has no bridge" in message
    assert "docs/weight_path.md" in message
