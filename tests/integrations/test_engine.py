"""The plugin's NPU Megatron engine inside the real verl 0.9.1, on CPU.

- verl's ``EngineRegistry`` returns it for ``VERL_ENGINE_DEVICE=npu`` / ``VERL_ENGINE_VENDOR=huawei``
  through the installed ``verl.plugins`` entry point (no registration in the tests);
- the model verl builds through mbridge has ``NPUFusionAttention`` in every layer, TE parameter
  names and the tiny Hugging Face checkpoint's weights;
- one forward/backward through verl's ``forward_backward_batch`` on a right-padded bshd batch:
  the loss equals the plugin's own computation and no ``[B, 1, S, S]`` mask is allocated.

These tests need only the model, so they build it with the engine's own ``_build_tf_config`` /
``_build_megatron_module``, the two steps ``engine.initialize()`` runs first; the whole
``initialize()`` (optimizer, scheduler, checkpoint manager) and verl's training loop are in
``test_loop.py``.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points

import pytest
import torch

pytest.importorskip("verl")

from safetensors.torch import load_file
from verl.models.mcore.util import _build_npu_attn_mask
from verl.workers.engine import EngineRegistry
from verl.workers.engine.megatron import MegatronEngineWithLMHead
from verl.workers.engine_workers import TrainingWorker

from mcore_npu.integrations.verl.engine import (
    NPUMegatronEngineWithLMHead,
    NPUMegatronEngineWithValueHead,
)
from mcore_npu.tools.bench.memory import track_allocations
from mcore_npu.transformer.attention import NPUFusionAttention
from tests.integrations.conftest import engine_model, training_worker_config
from tests.integrations.log_probs import mean_negative_log_prob, packed_batch
from tests.launch import run_command

LENGTHS = (9, 6, 4)  # right-padded to S = 9: a [B, 1, S, S] bool mask would be 243 bytes


def test_entry_point_is_installed_and_registered():
    (point,) = [ep for ep in entry_points(group="verl.plugins") if ep.name == "mcore_npu"]
    assert point.value == "mcore_npu.integrations.verl.plugin:registered"
    point.load()
    megatron = {model_type: EngineRegistry._engines[model_type]["megatron"][("npu", "huawei")]
                for model_type in ("language_model", "value_model")}  # fmt: skip
    assert megatron == {"language_model": NPUMegatronEngineWithLMHead,
                        "value_model": NPUMegatronEngineWithValueHead}  # fmt: skip
    assert "torch_npu" not in sys.modules  # loading it imported no torch_npu


_LAZY_PROBE = (
    "import sys, verl\n"
    "print('mcore_npu.integrations.verl.plugin' in sys.modules, 'megatron.core' in sys.modules)\n"
    "from verl.workers.engine import EngineRegistry\n"
    "print(('npu', 'huawei') in EngineRegistry._engines['language_model']['megatron'],"
    " sys.meta_path[0].__class__.__name__)\n"
)


def test_the_plugin_costs_a_process_nothing_until_verl_imports_its_engine_registry():
    """verl loads the plugin in every process that imports it (Ray's agent-loop, reward and
    rollout actors too); Megatron is imported only with verl's engine registry, which then holds
    the engines at once, and the one-shot import hook is gone."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    result = run_command([sys.executable, "-c", _LAZY_PROBE], env=env, check=True, timeout=300)
    loaded, registered = result.stdout.strip().splitlines()[-2:]
    assert loaded == "True False"
    assert registered.split()[0] == "True" and registered.split()[1] != "_AfterImport"


def test_registry_returns_the_npu_engine_for_npu_huawei(npu_engine_env):
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is (
        NPUMegatronEngineWithLMHead
    )
    assert EngineRegistry.get_engine_cls("value_model", "megatron") is (
        NPUMegatronEngineWithValueHead
    )


def test_registry_unchanged_for_other_devices(monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "nvidia")
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is MegatronEngineWithLMHead


_PROBE = (
    "import sys, verl\n"
    "from verl.workers.engine import EngineRegistry\n"
    "print(('npu', 'huawei') in EngineRegistry._engines['language_model']['megatron'],"
    " 'mcore_npu' in sys.modules)\n"
)


def test_verl_use_external_plugins_none_loads_nothing():
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none", "PYTHONWARNINGS": "ignore"}
    result = run_command([sys.executable, "-c", _PROBE], env=env, check=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1] == "False False"


def test_listed_by_name_it_loads():
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "MCORE_NPU", "PYTHONWARNINGS": "ignore"}
    result = run_command([sys.executable, "-c", _PROBE], env=env, check=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1] == "True True"  # verl lower-cases the list


_ENGINE_FIRST = (
    "import sys\n"
    "import mcore_npu.integrations.verl.engine\n"  # before verl: verl loads the plugin mid-import
    "from verl.workers.engine import EngineRegistry\n"
    "print(('npu', 'huawei') in EngineRegistry._engines['language_model']['megatron'])\n"
)


@pytest.mark.parametrize(("plugins", "registered"), [("auto", "True"), ("none", "False")])
def test_engine_module_imported_before_verl_still_registers_once_verl_loads_the_plugin(
    plugins, registered
):
    """engine.py imports verl, whose plugin loading imports engine.py half built: the plugin
    defers, and the engine module registers at its end; unless verl was told to load nothing."""
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": plugins, "PYTHONWARNINGS": "ignore"}
    result = run_command([sys.executable, "-c", _ENGINE_FIRST], env=env, check=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1] == registered


# ---------------------------------------------------------------------------------------------
# the model and one step, through a TrainingWorker with the plugin's engine
# ---------------------------------------------------------------------------------------------


def _build_engine(model_path: str, *, remove_padding: bool):
    """A TrainingWorker's engine (the plugin's, picked by verl) with its model built."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VERL_ENGINE_DEVICE", "npu")
        env.setenv("VERL_ENGINE_VENDOR", "huawei")
        worker = TrainingWorker(training_worker_config(model_path, remove_padding=remove_padding))
    engine = worker.engine
    engine._build_tf_config()  # the first two steps of engine.initialize()
    engine.module = engine._build_megatron_module()
    return engine


@pytest.fixture(scope="module")
def built_engine(cpu_runtime, tiny_hf_model):
    """bshd (``use_remove_padding=False``)."""
    return _build_engine(tiny_hf_model, remove_padding=False)


def test_every_layer_is_npu_fusion_attention(built_engine):
    assert type(built_engine) is NPUMegatronEngineWithLMHead
    layers = engine_model(built_engine).decoder.layers
    assert len(layers) == 2
    for layer in layers:
        assert isinstance(layer.self_attention.core_attention, NPUFusionAttention)


def test_te_names_and_hf_weights_loaded_through_the_bridge(built_engine, tiny_hf_model):
    params = dict(engine_model(built_engine).named_parameters())
    hf = load_file(os.path.join(tiny_hf_model, "model.safetensors"))
    pairs = {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": (
            "model.layers.0.input_layernorm.weight"
        ),
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight": (
            "model.layers.1.post_attention_layernorm.weight"
        ),
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.layers.1.self_attention.linear_proj.weight": (
            "model.layers.1.self_attn.o_proj.weight"
        ),
    }
    for ours, theirs in pairs.items():
        assert ours in params, sorted(params)
        torch.testing.assert_close(params[ours].float(), hf[theirs].to(torch.bfloat16).float())


def _own_loss(engine, ids) -> float:
    """The plugin's own computation: the same model, called directly, log-softmax in fp32."""
    seq = max(LENGTHS)
    tokens = torch.zeros(len(ids), seq, dtype=torch.long)
    for row, sample in enumerate(ids):
        tokens[row, : len(sample)] = sample
    positions = torch.arange(seq).expand(len(ids), seq)
    with torch.no_grad():
        logits = engine.module[0](input_ids=tokens, attention_mask=None, position_ids=positions)
    labels = torch.roll(tokens, -1, dims=1)
    log_probs = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1))[..., 0]
    real = torch.cat([log_probs[row, :n] for row, n in enumerate(LENGTHS)])
    return float(-real.mean())


def _dense_mask_bytes() -> int:
    return len(LENGTHS) * max(LENGTHS) ** 2  # bool [B, 1, S, S]


def test_tracker_sees_a_dense_mask_when_one_is_built():
    keep = torch.arange(max(LENGTHS)) < torch.tensor(LENGTHS).unsqueeze(1)
    with track_allocations() as usage:
        mask = _build_npu_attn_mask(keep)  # what verl's bshd path builds on NPU
    assert mask.shape == (len(LENGTHS), 1, max(LENGTHS), max(LENGTHS))
    assert usage.peak_bytes >= _dense_mask_bytes()


def test_forward_backward_through_verl_matches_own_loss_without_dense_mask(built_engine):
    data, ids = packed_batch(LENGTHS)
    with track_allocations() as usage:
        result = built_engine.forward_backward_batch(data, mean_negative_log_prob)
    (loss,) = result["loss"]
    assert abs(loss - _own_loss(built_engine, ids)) < 1e-5
    assert [len(row) for row in result["model_output"]["log_probs"].unbind()] == list(LENGTHS)
    grads = [p.main_grad for p in built_engine.module[0].parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    assert usage.allocations > 0
    assert _dense_mask_bytes() not in usage.sizes


def test_thd_batch_through_verls_packed_path(cpu_runtime, tiny_hf_model, built_engine):
    """thd (verl's default): verl's own packed path, PackedSeqParams into NPUFusionAttention.

    Same weights and batch as the bshd test; bf16 activations with a different layout, so the
    two losses agree to bf16 precision, not to 1e-5.
    """
    engine = _build_engine(tiny_hf_model, remove_padding=True)
    assert engine.engine_config.use_remove_padding
    data, ids = packed_batch(LENGTHS)
    (loss,) = engine.forward_backward_batch(data, mean_negative_log_prob)["loss"]
    assert abs(loss - _own_loss(built_engine, ids)) < 2e-2
    assert "mindspeed" not in sys.modules
