"""verl 0.9.1's default weight path (``vanilla_mbridge=False``) without Megatron-Bridge.

The verl environment has no Megatron-Bridge (no release imports without Transformer Engine), so
the plugin's engine builds these models through mbridge (``weight_path.mbridge_fallback``). Per
family, two ``TrainingWorker`` s are built from the same checkpoint in one process, one with
``vanilla_mbridge=True`` and one with ``False``; the second must log one fallback line, leave the
caller's config at ``False``, and give exactly (``==``) the first's log-probs through
``infer_batch`` and exactly its ``get_per_tensor_param`` tensors (the per-tensor generator verl
sends to the rollout). Qwen2 (Qwen2.5's ``model_type``), Qwen3-MoE, DeepSeek-V3 (q-LoRA with
yarn, and without q-LoRA with plain RoPE) and Nemotron-H (the plugin's ``NemotronHBridge``: a
Mamba2 hybrid, Megatron's ``MambaModel``) are built ``forward_only`` as verl builds the
reference model; Qwen3 as the actor (one ``train_batch`` step on each, then the comparisons) and
as the critic (``value_model``: the values ``==``). Nothing is mocked.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings

import pytest
import torch

pytest.importorskip("verl")

from mcore_npu.integrations.verl.engine import (
    NPUMegatronEngineWithLMHead,
    NPUMegatronEngineWithValueHead,
)
from tests.integrations import verl_loop as loop
from tests.integrations.conftest import save_tiny_deepseek_v3

pytestmark = pytest.mark.usefixtures("cpu_runtime", "own_attention_variables")

FALLBACK_LOG = "mcore_npu.integrations.verl.weight_path"
# DeepSeek-V3 on a CPU: Megatron's fused bias-dropout-add is torch.compile'd (~10 s first call)
DEEPSEEK_CPU = {"bias_dropout_fusion": False}
NO_Q_LORA_PLAIN_ROPE = dict(q_lora_rank=None,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip


def _config(path, vanilla: bool, *, override=None, **fields):
    """``verl_loop.worker_config`` with ``vanilla_mbridge`` (and ``override_transformer_config``)."""
    config = loop.worker_config(path, total_steps=2, **fields)
    engine = dataclasses.replace(config.engine_config, vanilla_mbridge=vanilla,
                                 override_transformer_config=dict(override or {}))  # fmt: skip
    return dataclasses.replace(config, engine_config=engine)


def _pair(path, caplog, loss_fn, **fields):
    """``(mbridge worker, default-path worker)``: ``vanilla_mbridge`` True, then False.

    Checks on the second: one fallback log line naming the model type (and no verl deprecation
    warning), mbridge built it (a bridge, no Megatron-Bridge provider), its own engine config
    says True, the caller's False.
    """
    mbridge = loop.new_worker(_config(path, True, **fields), loss_fn)
    caplog.clear()
    config = _config(path, False, **fields)
    with (
        caplog.at_level(logging.WARNING, logger=FALLBACK_LOG),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        default = loop.new_worker(config, loss_fn)
    # verl's deprecation warning for vanilla_mbridge=True is not shown: the user did not set it
    assert not [w for w in caught if "legacy mbridge backend" in str(w.message)]
    lines = [r.getMessage() for r in caplog.records if r.name == FALLBACK_LOG]
    assert len(lines) == 1, lines
    model_type = default.engine.model_config.hf_config.model_type
    assert f"building {model_type!r} through mbridge" in lines[0]
    assert "vanilla_mbridge=False selects Megatron-Bridge" in lines[0]
    for worker, fallback in ((mbridge, False), (default, True)):
        engine = worker.engine
        assert engine.mbridge_fallback is fallback
        assert engine.provider is None and engine.bridge is not None and engine.vanilla_bridge
        assert engine.engine_config.vanilla_mbridge is True
    assert config.engine_config.vanilla_mbridge is False  # the caller's config unchanged
    assert default.config.engine_config.vanilla_mbridge is False
    return mbridge, default


def _log_probs(worker) -> list[torch.Tensor]:
    """verl's ``infer_batch`` log-probs of four seeded SFT samples (one row each)."""
    from verl.utils import tensordict_utils as tu

    samples = loop.sft_samples(3)[:4]
    data = tu.get_tensordict(
        {"input_ids": tu.nested_tensor_from_tensor_list(samples),
         "loss_mask": tu.nested_tensor_from_tensor_list([torch.ones_like(s) for s in samples])},
        {"temperature": 1.0, "compute_loss": False, "micro_batch_size_per_gpu": 2},
    )  # fmt: skip
    return [row.clone() for row in tu.get(worker.infer_batch(data), "log_probs").unbind()]


def _exported(worker) -> dict[str, torch.Tensor]:
    """``get_per_tensor_param``: the ``(hf_name, tensor)`` pairs verl sends to the rollout."""
    generator, peft = worker.engine.get_per_tensor_param()
    assert peft is None
    return {name: tensor.detach().clone() for name, tensor in generator}


def _assert_same(mbridge, default) -> int:
    """Log-probs ``==`` and exports ``==`` (same names, dtypes, values); the export's size."""
    want, got = _log_probs(mbridge), _log_probs(default)
    assert len(got) == len(want) == 4
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(torch.isfinite(w).all() and (w < 0).all() for w in want)
    want_export, got_export = _exported(mbridge), _exported(default)
    assert list(got_export) == list(want_export)  # the same names in the same order
    for name, tensor in want_export.items():
        assert got_export[name].dtype == tensor.dtype, name
        assert torch.equal(got_export[name], tensor), name
    return len(want_export)


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> str:
    """The tiny DeepSeek-V3 without q-LoRA and with plain RoPE (conftest's has both)."""
    path = tmp_path_factory.mktemp("deepseek_v3_plain")
    save_tiny_deepseek_v3(path, **NO_Q_LORA_PLAIN_ROPE)
    return str(path)


@pytest.mark.parametrize(
    "checkpoint, override",
    [("tiny_hf_model", None), ("qwen3_moe", None), ("tiny_deepseek_v3_model", DEEPSEEK_CPU),
     ("deepseek_v3", DEEPSEEK_CPU), ("nemotron_h", None)],
    ids=["qwen2", "qwen3_moe", "deepseek_v3_q_lora_yarn", "deepseek_v3_plain", "nemotron_h"],
)  # fmt: skip
def test_reference_model_on_the_default_path_equals_mbridge(request, caplog, checkpoint, override):
    """``forward_only`` workers, as verl builds the reference model (its ``vanilla_mbridge``
    follows the actor's, whose default is False)."""
    path = request.getfixturevalue(checkpoint)
    mbridge, default = _pair(path, caplog, loop.sft_loss_fn(), override=override,
                             forward_only=True)  # fmt: skip
    assert type(default.engine) is NPUMegatronEngineWithLMHead
    assert default.engine.optimizer is None
    count = _assert_same(mbridge, default)
    print(f"{checkpoint}: log-probs and {count} exported tensors equal")


def test_actor_on_the_default_path_trains_as_mbridge(qwen3, caplog):
    """The actor (optimizer, scheduler): one SFT ``train_batch`` on each gives the same loss and
    grad norm, and the trained weights give the same log-probs and exports."""
    mbridge, default = _pair(qwen3, caplog, loop.sft_loss_fn())
    want, got = loop.train_sft(mbridge, 1)[0], loop.train_sft(default, 1)[0]
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert want["grad_norm"] > 0
    _assert_same(mbridge, default)


def test_critic_on_the_default_path_equals_mbridge(qwen3, caplog):
    """The critic (``value_model``, its own ``critic.megatron.vanilla_mbridge``): the values of
    a rollout batch ``==``, and so the value loss."""
    from verl.utils import tensordict_utils as tu

    mbridge, default = _pair(qwen3, caplog, loop.value_loss_fn(), model_type="value_model")
    assert type(default.engine) is NPUMegatronEngineWithValueHead
    batch = loop.rollout_batch(0)
    values = []
    for worker in (mbridge, default):
        data = loop.to_engine_layout(batch, compute_loss=False)
        values.append(tu.get(worker.infer_batch(data), "values").values().clone())
    assert values[0].numel() > 0 and torch.equal(values[1], values[0])


def test_verls_defaults_send_actor_reference_and_critic_down_this_path():
    """verl's composed PPO Megatron config (``_generated_ppo_megatron_trainer.yaml``): the
    actor's and the critic's ``vanilla_mbridge`` default to False, the reference model's follows
    the actor's, and the reference engine is ``forward_only`` (as the workers above are built)."""
    import verl
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import McoreEngineConfig

    trainer = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    config = OmegaConf.load(os.path.join(trainer, "_generated_ppo_megatron_trainer.yaml"))
    roles = config.actor_rollout_ref
    engines = {name: omega_conf_to_dataclass(section) for name, section in
               (("actor", roles.actor.megatron), ("ref", roles.ref.megatron),
                ("critic", config.critic.megatron))}  # fmt: skip
    assert all(type(engine) is McoreEngineConfig for engine in engines.values())
    assert {name: engine.vanilla_mbridge for name, engine in engines.items()} == {
        "actor": False, "ref": False, "critic": False}  # fmt: skip
    assert engines["ref"].forward_only and not engines["actor"].forward_only
    roles.actor.megatron.vanilla_mbridge = True
    assert roles.ref.megatron.vanilla_mbridge is True  # follows the actor's
    assert config.critic.megatron.vanilla_mbridge is False  # its own key
