"""verl 0.9.1's default bridge, Megatron-Bridge (``vanilla_mbridge=False``), with the plugin's engine.

No Megatron-Bridge release imports next to megatron-core 0.16.1 without Transformer Engine (the
README's verl section, "Megatron-Bridge", has the versions and the failing import), so the verl
environment has none. What is tested is what a user meets: the engine stops at the start of
``_build_tf_config`` with a ``ValueError`` that names the missing module and ``vanilla_mbridge=True``,
instead of verl's "pip install megatron-bridge" print and a bare ``ImportError`` from
``verl/models/mcore/bridge.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

pytest.importorskip("verl")

from verl.workers.engine_workers import TrainingWorker

from mcore_npu.integrations.verl.engine import (
    NPUMegatronEngineWithLMHead,
    megatron_bridge_unavailable,
)
from tests.integrations.conftest import training_worker_config


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


def test_vanilla_mbridge_false_stops_with_what_to_set(cpu_runtime, tiny_hf_model, capsys):
    assert importlib.util.find_spec("megatron.bridge") is None  # the verl env has none (README)
    engine = _megatron_bridge_engine(tiny_hf_model)
    with pytest.raises(ValueError, match=r"vanilla_mbridge=False selects Megatron-Bridge") as info:
        engine._build_tf_config()
    message = str(info.value)
    assert "megatron-bridge package is not installed" in message
    assert "actor_rollout_ref.actor.megatron.vanilla_mbridge=True" in message
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert info.value.__cause__.name == "megatron.bridge"
    # stopped before verl's own import of megatron.bridge (which prints and re-raises)
    assert "Megatron-Bridge package not found" not in capsys.readouterr().out


def test_the_reason_names_transformer_engine_when_megatron_bridge_needs_it():
    """A megatron-bridge installed with ``--no-deps`` fails on this import (0.3.1:
    ``megatron/bridge/peft/lora_layers.py``, line 20); the message says so."""
    with pytest.raises(ImportError) as missing:
        import transformer_engine.pytorch  # noqa: F401
    message = megatron_bridge_unavailable(missing.value)
    assert "imports transformer_engine" in message and "no Ascend build" in message
    assert "critic.megatron.vanilla_mbridge=True" in message
