"""verl 0.9.1's whole training loop with the plugin's engine, on CPU, one process (no Ray).

verl's ``TrainingWorker`` (its engine picked by verl's registry for ``("npu", "huawei")``) runs
``reset()`` = ``engine.initialize()`` to the end: the bf16 model, Megatron's distributed optimizer
with fp32 main parameters, verl's LR scheduler and checkpoint manager. Then it is driven as verl's
trainers drive it (``tests/integrations/verl_loop.py``): ``train_batch`` with verl's SFT loss,
``infer_batch`` + ``train_mini_batch`` with verl's PPO loss on a GRPO rollout batch, the critic
with verl's value loss, ``save_checkpoint`` / ``load_checkpoint`` into a fresh worker, and
``get_per_tensor_param`` (the weights verl sends to the rollout) into ``transformers``.

What makes ``initialize()`` and ``train_batch`` finish on a CPU are the shims of
``mcore_npu.training.cpu_support`` (applied by the ``cpu_runtime`` fixture; their table names
the Megatron / verl lines). What makes resume exact is the engine's ``load_checkpoint``
(``mcore_npu.training.optimizer_resume``), needed wherever Megatron's distributed optimizer runs
over torch's Adam: on an NPU as here. Nothing in verl or Megatron is mocked; the only stand-in in
this folder is the NPU allocator of ``test_workers.py``. Two tests put an instance-level spy on
one engine method (``optimizer_step``: the gradients before the update; ``_mask_free_step``:
that bshd took it), which records and calls through.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

import transformers
from safetensors.torch import load_file
from verl.workers.engine.megatron import MegatronEngineWithLMHead

from mcore_npu.integrations.verl.engine import (
    NPUMegatronEngineWithLMHead,
    NPUMegatronEngineWithValueHead,
)
from mcore_npu.transformer.attention import NPUFusionAttention
from tests.integrations import verl_loop as loop
from tests.integrations.conftest import SFT_STEPS, engine_model
from tests.integrations.log_probs import infer_log_probs

DENSE = loop.FAMILY_SETTINGS["qwen3"]  # the settings of the dense SFT run (conftest)

pytestmark = pytest.mark.usefixtures("cpu_runtime")


def _losses(metrics) -> list[float]:
    return [m["loss"] for m in metrics]


# ---------------------------------------------------------------------------------------------
# initialize() and SFT through train_batch
# ---------------------------------------------------------------------------------------------


def test_initialize_builds_megatrons_distributed_optimizer_with_fp32_main_params(dense_sft_run):
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    worker, _ = dense_sft_run
    engine = worker.engine
    assert type(engine) is NPUMegatronEngineWithLMHead
    assert isinstance(engine.optimizer, ChainedOptimizer)
    (optimizer,) = engine.optimizer.chained_optimizers
    assert isinstance(optimizer, DistributedOptimizer)
    assert type(optimizer.optimizer) in (torch.optim.Adam, torch.optim.AdamW)  # no Apex, no TE
    model_params = [p for group in optimizer.model_float16_groups for p in group]
    main_params = [p for group in optimizer.shard_fp32_from_float16_groups for p in group]
    assert model_params and len(main_params) == len(model_params)
    assert {p.dtype for p in model_params} == {torch.bfloat16}
    assert {p.dtype for p in main_params} == {torch.float32}
    assert isinstance(engine.lr_scheduler, OptimizerParamScheduler)
    assert engine.checkpoint_mananager is not None  # (verl's spelling)
    layers = engine_model(engine).decoder.layers
    assert all(isinstance(x.self_attention.core_attention, NPUFusionAttention) for x in layers)


def test_thirty_sft_steps_lower_the_loss_by_a_third(dense_sft_run):
    _, metrics = dense_sft_run
    losses = _losses(metrics)
    assert len(losses) == SFT_STEPS
    drop = 1 - losses[-1] / losses[0]
    print(f"SFT thd: {losses[0]:.4f} -> {losses[-1]:.4f} over {SFT_STEPS} steps ({drop:.1%})")
    assert drop >= 0.30, f"{losses[0]:.4f} -> {losses[-1]:.4f} ({drop:.1%})"
    last = metrics[-1]
    assert last["grad_norm"] > 0 and last["lr"] >= 0
    assert last["mfu"] > 0  # verl's FLOPs counter ran (global_token_num was passed)


def test_bshd_sft_steps_start_where_thd_does_and_fall(qwen3, dense_sft_run):
    """bshd (``use_remove_padding=False``: the engine's mask-free path) on the same weights and
    batch: the first loss equals thd's to bf16 precision, and the loss falls."""
    _, thd = dense_sft_run
    config = loop.worker_config(qwen3, remove_padding=False, **DENSE)
    worker = loop.new_worker(config, loop.sft_loss_fn())
    losses = _losses(loop.train_sft(worker, 4))
    print(f"bshd: first loss {losses[0]:.6f} vs thd {thd[0]['loss']:.6f}; 4 steps: {losses}")
    assert abs(losses[0] - thd[0]["loss"]) < 2e-2, (losses[0], thd[0]["loss"])
    assert losses[-1] < losses[0] - 0.1, losses


def test_qwen3_moe_sft_steps_lower_the_loss(moe_sft_run):
    from mcore_npu.training.optimizer_resume import torch_adam_distributed_optimizers

    worker, metrics = moe_sft_run
    # dense and expert parameters: two distributed optimizers, both repaired on resume
    assert len(torch_adam_distributed_optimizers(worker.engine.optimizer)) == 2
    losses = _losses(metrics)
    assert losses[-1] < losses[0] - 0.1, losses


def test_qwen3_moe_bshd_starts_where_thd_does_and_falls(qwen3_moe, moe_sft_run):
    _, thd = moe_sft_run
    config = loop.worker_config(
        qwen3_moe, remove_padding=False, **loop.FAMILY_SETTINGS["qwen3_moe"]
    )
    losses = _losses(loop.train_sft(loop.new_worker(config, loop.sft_loss_fn()), 3))
    print(f"MoE bshd: first loss {losses[0]:.6f} vs thd {thd[0]['loss']:.6f}; 3 steps: {losses}")
    assert abs(losses[0] - thd[0]["loss"]) < 2e-2, (losses[0], thd[0]["loss"])
    assert losses[-1] < losses[0] - 0.1, losses


def _packed(samples):
    """The SFT samples as the trainer's one packed micro-batch ``[1, T]``: labels are the next
    token of the same sample; the loss mask is verl's SFT mask (``loss_mask`` rolled by one:
    the prompt's and each sample's last position carry no loss)."""
    from mcore_npu.training.data import MicroBatch

    tokens = torch.cat(samples)[None]
    labels = torch.cat([torch.roll(s, -1) for s in samples])[None]
    mask = torch.cat([(torch.arange(len(s)) >= loop.PROMPT - 1) & (torch.arange(len(s)) < len(s) - 1)
                      for s in samples]).float()[None]  # fmt: skip
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    ends = torch.tensor([len(s) for s in samples]).cumsum(0)
    cu = torch.cat([torch.zeros(1), ends]).to(torch.int32)
    return MicroBatch(tokens, labels, mask, positions, cu_seqlens=cu,
                      max_seqlen=max(len(s) for s in samples),
                      seq_ends=tuple(int(e) for e in ends))  # fmt: skip


def test_one_step_equals_the_plugins_own_trainer(tmp_path):
    """verl's ``train_batch`` (SFT loss, thd, one micro-batch) and the plugin's own trainer
    (its model, packed thd micro-batch, masked-mean loss, DDP, through Megatron's schedule) on
    the same weights and batch: the same loss and the same fp32 gradients.

    Both are bf16 models (verl's config refuses fp32) computing the same bf16 operations in
    the same order, so the tolerance stays at fp32 level: loss within 1e-5, every gradient
    within 1e-5 of the largest gradient element (measured: see docs/verl.md). The trainer's
    byte-level data needs a vocabulary of at least 257, so this Qwen3 has 264 (the trainer's
    default)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    qwen3 = loop.save_checkpoint("qwen3", tmp_path, vocab=264)
    config = loop.worker_config(qwen3, micro_batch=len(loop.SFT_LENGTHS), **DENSE)
    worker = loop.new_worker(config, loop.sft_loss_fn())
    gpt = engine_model(worker.engine)
    verl_grads = {}
    step = worker.engine.optimizer_step

    def snapshot_then_step():  # a spy on verl's own call: the gradients before the update
        verl_grads.update({n: p.main_grad.clone() for n, p in gpt.named_parameters()})
        return step()

    worker.engine.optimizer_step = snapshot_then_step
    weights = {k: v.clone() if torch.is_tensor(v) else v for k, v in gpt.state_dict().items()}
    (metrics,) = loop.train_sft(worker, 1)

    trainer = loop.own_trainer(qwen3)
    own = trainer.model.module.module  # DDP -> Float16Module -> GPTModel
    own.load_state_dict(weights, strict=True)
    trainer.model.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=trainer._forward_step, data_iterator=iter([_packed(loop.sft_samples(0))]),
        model=[trainer.model], num_microbatches=1, seq_length=1, micro_batch_size=1,
        forward_only=False,
    )  # fmt: skip
    own_loss = float(losses[0]["lm loss"])
    own_grads = {n: p.main_grad for n, p in own.named_parameters()}
    assert own_grads.keys() == verl_grads.keys()
    scale = max(float(g.abs().max()) for g in verl_grads.values())
    grad_error = max(float((own_grads[n] - verl_grads[n]).abs().max()) for n in own_grads)
    print(f"loss {metrics['loss']:.7f} vs {own_loss:.7f}; grads {grad_error:.2e} of {scale:.2e}")
    assert abs(metrics["loss"] - own_loss) <= 1e-5
    assert grad_error <= 1e-5 * scale


# ---------------------------------------------------------------------------------------------
# the GRPO actor update and the critic
# ---------------------------------------------------------------------------------------------

UPDATES = 5


def test_grpo_actor_update_lowers_the_policy_loss(qwen3):
    """verl's PPO loss (vanilla clipped policy loss) on a GRPO rollout batch: old log-probs from
    ``infer_batch`` (as ``compute_log_prob``), GRPO advantages from verl's
    ``compute_grpo_outcome_advantage``, 5 ``train_mini_batch`` updates; the loss on the same
    batch, re-measured with ``infer_batch`` after each update, goes down every time."""
    worker = loop.new_worker(loop.worker_config(qwen3, total_steps=10, lr=1e-4), loop.ppo_loss_fn())
    batch = loop.rollout_batch(0)
    batch["old_log_probs"] = loop.old_log_probs(worker, batch)
    batch["advantages"] = loop.grpo_advantages(batch)
    assert batch["advantages"].abs().sum() > 0
    losses = [loop.forward_loss(worker, batch)]
    for _ in range(UPDATES):
        metrics = loop.update(worker, batch)
        assert metrics["grad_norm"][0] > 0
        losses.append(loop.forward_loss(worker, batch))
    print(f"GRPO policy loss on the batch: {losses}")
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert metrics["actor/ppo_kl"][0] != 0  # the policy moved away from the rollout's


@pytest.mark.parametrize("remove_padding", [True, False], ids=["thd", "bshd"])
def test_critic_value_loss_falls(qwen3, remove_padding):
    """``NPUMegatronEngineWithValueHead`` (verl's ``value_model``) through verl's value loss,
    thd and bshd (the value engine's mask-free path)."""
    config = loop.worker_config(qwen3, model_type="value_model", total_steps=10,
                                remove_padding=remove_padding)  # fmt: skip
    worker = loop.new_worker(config, loop.value_loss_fn())
    assert type(worker.engine) is NPUMegatronEngineWithValueHead
    assert engine_model(worker.engine).output_layer.weight.shape[0] == 1  # the value head
    mask_free = _count_calls(worker.engine, "_mask_free_step")
    batch = loop.rollout_batch(0)
    generator = torch.Generator().manual_seed(3)
    batch["values"] = 0.1 * torch.randn(batch["response_mask"].shape, generator=generator)
    batch["returns"] = torch.randn(batch["response_mask"].shape, generator=generator)
    losses = [loop.forward_loss(worker, batch)]
    for _ in range(UPDATES):
        loop.update(worker, batch)
        losses.append(loop.forward_loss(worker, batch))
    print(f"critic value loss ({'thd' if remove_padding else 'bshd'}) on the batch: {losses}")
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert (len(mask_free) > 0) is (not remove_padding)  # bshd: the engine's mask-free path


def _count_calls(engine, name: str) -> list:
    """Record each call of ``engine.<name>`` (an instance-level spy that calls through)."""
    calls, method = [], getattr(engine, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return method(*args, **kwargs)

    setattr(engine, name, spy)
    return calls


# ---------------------------------------------------------------------------------------------
# checkpoints: resume through verl's save_checkpoint / load_checkpoint
# ---------------------------------------------------------------------------------------------

RESUME_AT, RESUME_END = 5, 10


def _resume_config(path, fully_reshardable: bool):
    return loop.worker_config(path, total_steps=RESUME_END,
                              dist_ckpt_optim_fully_reshardable=fully_reshardable)  # fmt: skip


@pytest.fixture(scope="module", params=[False, True], ids=["dp_reshardable", "fully_reshardable"])
def uninterrupted(request, qwen3, tmp_path_factory):
    """10 SFT steps, saved through verl after step 5: ``(format, losses 6-10, checkpoint)``."""
    config = _resume_config(qwen3, request.param)
    worker = loop.new_worker(config, loop.sft_loss_fn())
    loop.train_sft(worker, RESUME_AT)
    checkpoint = tmp_path_factory.mktemp("resume")
    worker.save_checkpoint(str(checkpoint), global_step=RESUME_AT)
    later = _losses(loop.train_sft(worker, RESUME_END - RESUME_AT))
    return request.param, later, str(checkpoint)


def test_resume_in_a_fresh_worker_is_exact(qwen3, uninterrupted):
    fully_reshardable, later, checkpoint = uninterrupted
    worker = loop.new_worker(_resume_config(qwen3, fully_reshardable), loop.sft_loss_fn())
    worker.load_checkpoint(checkpoint)
    optimizer = worker.engine.optimizer.chained_optimizers[0].optimizer
    steps = [state["step"] for state in optimizer.state.values()]
    assert {float(step) for step in steps} == {float(RESUME_AT)}
    assert len({id(step) for step in steps}) == len(steps)  # one counter per parameter
    resumed = _losses(loop.train_sft(worker, RESUME_END - RESUME_AT))
    error = max(abs(a - b) for a, b in zip(resumed, later, strict=True))
    print(f"resume ({'fully_reshardable' if fully_reshardable else 'dp_reshardable'}): "
          f"max |loss - uninterrupted| over steps 6-10 = {error:.2e}")  # fmt: skip
    assert error <= 1e-6, (resumed, later)


def test_checkpoint_holds_te_names_and_the_distributed_optimizer(uninterrupted):
    """The model's parameters are TE names; with ``fully_reshardable`` the optimizer's state is
    keyed by them, the default format keeps the distributed optimizer's buckets."""
    from torch.distributed.checkpoint import FileSystemReader

    fully_reshardable, _, checkpoint = uninterrupted
    root = Path(checkpoint)
    keys = set(
        FileSystemReader(root / "optimizer" / "dist_ckpt").read_metadata().state_dict_metadata
    )
    if fully_reshardable:
        te = [k for k in keys if "self_attention.linear_qkv.layer_norm_weight" in k]
        assert te and not [k for k in keys if "input_layernorm" in k], sorted(keys)[:20]
    else:
        assert any(".bucket_idx_0.exp_avg" in k for k in keys), sorted(keys)[:20]
    contents = json.loads((root / "ckpt_contents.json").read_text())["contents"]
    assert contents["model"]["format"] == "huggingface"  # verl: the bridge writes the weights
    assert {"optimizer", "lr_scheduler", "rng_state"} <= set(contents), contents


def test_without_the_engines_load_verls_megatron_load_fails_or_drifts(qwen3, uninterrupted):
    """Controls, so the exact resume above can be seen to matter: verl's own
    ``MegatronEngine.load_checkpoint`` into a fresh worker asserts (the empty torch-Adam state);
    past that assertion (the fresh state allocated, nothing else), the step counter comes back
    as 0 and the resumed losses drift from the uninterrupted ones."""
    from mcore_npu.training.optimizer_resume import torch_adam_distributed_optimizers

    fully_reshardable, later, checkpoint = uninterrupted
    config = _resume_config(qwen3, fully_reshardable)
    worker = loop.new_worker(config, loop.sft_loss_fn())
    with pytest.raises(AssertionError):
        MegatronEngineWithLMHead.load_checkpoint(worker.engine, checkpoint)
    if fully_reshardable:  # the per-parameter copy then raises KeyError('step'): shown once
        worker = loop.new_worker(config, loop.sft_loss_fn())
        _allocate_like_adam(worker.engine.optimizer)
        with pytest.raises(KeyError, match="step"):
            MegatronEngineWithLMHead.load_checkpoint(worker.engine, checkpoint)
        return
    worker = loop.new_worker(config, loop.sft_loss_fn())
    _allocate_like_adam(worker.engine.optimizer)
    MegatronEngineWithLMHead.load_checkpoint(worker.engine, checkpoint)
    (member,) = torch_adam_distributed_optimizers(worker.engine.optimizer)
    assert {float(s["step"]) for s in member.optimizer.state.values()} == {0.0}
    resumed = _losses(loop.train_sft(worker, RESUME_END - RESUME_AT))
    drift = max(abs(a - b) for a, b in zip(resumed[1:], later[1:]))
    print(f"verl's own load (step counter 0): losses 7-10 drift by up to {drift:.2e}")
    assert resumed[0] == pytest.approx(later[0], abs=1e-6)  # computed before the first update
    assert max(abs(a - b) for a, b in zip(resumed[1:], later[1:])) > 1e-3, (resumed, later)


def _allocate_like_adam(optimizer) -> None:
    """What torch's Adam holds before its first step (zero moments, step 0), per parameter."""
    from mcore_npu.training.optimizer_resume import torch_adam_distributed_optimizers

    for member in torch_adam_distributed_optimizers(optimizer):
        inner = member.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                      exp_avg_sq=torch.zeros_like(p))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# the weights the rollout gets: get_per_tensor_param, and the checkpoint's hf_model
# ---------------------------------------------------------------------------------------------

EXPORT_STEPS = 3


@pytest.fixture(scope="module")
def exported(qwen3, tmp_path_factory):
    """A worker after 3 optimizer steps; its ``get_per_tensor_param`` tensors; the HF model
    verl's checkpoint manager writes (``save_contents`` with ``hf_model``)."""
    import dataclasses

    config = loop.worker_config(qwen3, total_steps=EXPORT_STEPS)
    config = dataclasses.replace(
        config,
        checkpoint_config=dataclasses.replace(
            config.checkpoint_config, save_contents=["model", "optimizer", "extra", "hf_model"]
        ),
    )
    worker = loop.new_worker(config, loop.sft_loss_fn())
    loop.train_sft(worker, EXPORT_STEPS)
    generator, peft = worker.engine.get_per_tensor_param()
    tensors = {name: tensor.detach().clone() for name, tensor in generator}
    checkpoint = tmp_path_factory.mktemp("export")
    worker.save_checkpoint(str(checkpoint), global_step=EXPORT_STEPS)
    return worker, tensors, peft, checkpoint


def _hf_model(qwen3, state: dict):
    """The transformers Qwen3 model of the checkpoint's config, fp32, holding ``state``."""
    config = transformers.AutoConfig.from_pretrained(qwen3)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model


def test_exported_names_are_exactly_the_hf_names(qwen3, exported):
    _, tensors, peft, _ = exported
    assert peft is None
    want = set(load_file(os.path.join(qwen3, "model.safetensors")))
    assert set(tensors) == want, sorted(set(tensors) ^ want)
    initial = load_file(os.path.join(qwen3, "model.safetensors"))
    moved = [
        n for n in tensors if not torch.equal(tensors[n].float(), initial[n].bfloat16().float())
    ]
    assert len(moved) > len(tensors) // 2  # the trained weights, not the initial ones


def _engine_logits(worker, ids: torch.Tensor) -> torch.Tensor:
    """``[S, V]`` fp32 logits of the engine's GPTModel for one sequence (cast to fp32 first)."""
    model = engine_model(worker.engine)
    model.float()
    with torch.no_grad():
        logits = model(input_ids=ids.unsqueeze(0), position_ids=torch.arange(len(ids))[None],
                       attention_mask=None)  # fmt: skip
    return logits[0].float()


def test_rollout_weights_give_the_engines_logits_in_transformers(qwen3, exported):
    """The exported tensors in a transformers Qwen3 (fp32): its logits equal the engine's forward
    on the same (bf16-valued) weights in fp32 within 1e-4; so do verl's log-probs. And the
    checkpoint manager's ``hf_model`` holds the same tensors."""
    worker, tensors, _, checkpoint = exported
    hf = _hf_model(qwen3, tensors)
    ids = loop.sft_samples(7)[0]
    with torch.no_grad():
        want = hf(input_ids=ids.unsqueeze(0)).logits[0].float()
    got = _engine_logits(worker, ids)  # casts the engine's model: the last use of this worker
    error = float((got - want).abs().max())
    print(f"exported weights in transformers: max |logit - engine| = {error:.2e}")
    assert error < 1e-4, error
    log_probs = infer_log_probs(worker, ids)[:-1]  # verl's infer_batch, the model now fp32
    want_lp = torch.log_softmax(want, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    lp_error = float((log_probs - want_lp).abs().max())
    print(f"verl's log-probs vs transformers': {lp_error:.2e}")
    assert lp_error < 1e-4
    saved = load_file(str(next((checkpoint / "model" / "huggingface").glob("*.safetensors"))))
    assert set(saved) == set(tensors)
    assert all(torch.equal(saved[n], tensors[n]) for n in tensors)
    config = transformers.AutoConfig.from_pretrained(checkpoint / "model" / "huggingface")
    assert config.model_type == "qwen3" and config.num_hidden_layers == 2
