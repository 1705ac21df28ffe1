"""verl's engine-level offload, checkpoint and batching settings with the plugin's engine, on CPU.

The recipes' ``megatron.*`` keys outside the optimizer (``recipe_settings.md``, section 2):
``param_offload`` / ``optimizer_offload`` (actor) and ``param_offload`` (reference model);
``use_dist_checkpointing`` + ``dist_checkpointing_path``; ``use_dynamic_bsz`` with
``ppo_max_token_len_per_gpu``; ``override_ddp_config.grad_reduce_in_fp32``. Each goes through
verl 0.9.1's real ``TrainingWorker`` (``tests/integrations/verl_loop.py``) with the tiny Qwen3.

On a CPU the "device" is host memory: verl's parameter offload is still a real copy (it copies
the DDP buffers into a separate ``cpu_data`` tensor and frees the originals; the engine copies the
reference model's parameters, see ``mcore_npu.integrations.verl.offload``), the optimizer
offload's ``.to("cpu")`` is not. No stand-in is used.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from verl.utils.device import get_device_name

from tests.integrations import verl_loop as loop
from tests.integrations.conftest import engine_model
from tests.integrations.log_probs import infer_log_probs

pytestmark = pytest.mark.usefixtures("cpu_runtime")

SETTINGS = {"total_steps": 4, "lr": 2e-3}
STEPS, SAVE_AT = 4, 2
OFFLOAD = {"param_offload": True, "optimizer_offload": True}


def _losses(metrics) -> list[float]:
    return [m["loss"] for m in metrics]


def _state(engine) -> dict[str, torch.Tensor]:
    """Clones of the model parameters, the fp32 main parameters and every Adam state tensor
    (moments and step), by name / position. The engine is loaded onto the device first."""
    engine.to(get_device_name(), model=True, optimizer=True, grad=True)
    out = {f"param.{n}": p.detach().clone() for n, p in engine_model(engine).named_parameters()}
    for k, member in enumerate(engine.optimizer.chained_optimizers):
        mains = [p for group in member.shard_fp32_from_float16_groups for p in group]
        out |= {f"main.{k}.{i}": p.detach().clone() for i, p in enumerate(mains)}
        for i, state in enumerate(member.optimizer.state.values()):
            out |= {f"adam.{k}.{i}.{key}": torch.as_tensor(v).clone() for key, v in state.items()}
    return out


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, differ[:10]


def _offloaded(engine) -> bool:
    """verl's param offload frees the DDP parameter buffers' storage between calls (the
    expert-parallel buffers of an MoE model too)."""
    chunk = engine.module[0]
    buffers = [*chunk.buffers, *chunk.expert_parallel_buffers]
    return all(b.param_data.untyped_storage().size() == 0 for b in buffers)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def plain(request, tmp_path_factory):
    """4 SFT steps without offload, for the tiny Qwen3 and the tiny Qwen3-MoE (dense and expert
    parameters: two distributed optimizers, expert-parallel buffers): the model path, the
    losses, the full state after step 2 and the checkpoint verl writes there."""
    path = request.getfixturevalue(request.param)
    worker = loop.new_worker(loop.worker_config(path, **SETTINGS), loop.sft_loss_fn())
    losses = _losses(loop.train_sft(worker, SAVE_AT))
    state = _state(worker.engine)
    checkpoint = tmp_path_factory.mktemp("plain")
    worker.save_checkpoint(str(checkpoint), global_step=SAVE_AT)
    losses += _losses(loop.train_sft(worker, STEPS - SAVE_AT))
    return {"path": path, "losses": losses, "state": state, "checkpoint": str(checkpoint)}


# ---------------------------------------------------------------------------------------------
# 1. param_offload / optimizer_offload
# ---------------------------------------------------------------------------------------------


def test_actor_offload_trains_saves_and_loads_bit_exactly(plain, tmp_path):
    """Actor with ``param_offload`` and ``optimizer_offload``: each step's loss equals the
    run without offload (``==``), so does the whole state after step 2 (``torch.equal``); its
    checkpoint, loaded into a fresh offloaded worker, restores that state bit for bit and the
    resumed steps 3-4 give the same losses."""
    config = loop.worker_config(plain["path"], **SETTINGS, **OFFLOAD)
    worker = loop.new_worker(config, loop.sft_loss_fn())
    assert _offloaded(worker.engine)  # after initialize()
    losses = _losses(loop.train_sft(worker, SAVE_AT))
    assert losses == plain["losses"][:SAVE_AT]
    assert _offloaded(worker.engine)  # after each step
    _assert_equal(_state(worker.engine), plain["state"])
    worker.engine.to("cpu", model=True, optimizer=True, grad=True)
    worker.save_checkpoint(str(tmp_path), global_step=SAVE_AT)
    assert _offloaded(worker.engine)  # save_checkpoint offloads again
    assert _losses(loop.train_sft(worker, STEPS - SAVE_AT)) == plain["losses"][SAVE_AT:]

    fresh = loop.new_worker(config, loop.sft_loss_fn())
    fresh.load_checkpoint(str(tmp_path))
    assert _offloaded(fresh.engine)
    _assert_equal(_state(fresh.engine), plain["state"])
    fresh.engine.to("cpu", model=True, optimizer=True, grad=True)
    assert _losses(loop.train_sft(fresh, STEPS - SAVE_AT)) == plain["losses"][SAVE_AT:]
    print(f"offload: losses {losses} ==; {len(plain['state'])} state tensors equal after step 2")
    if "moe" in plain["path"]:
        assert len(worker.engine.optimizer.chained_optimizers) == 2  # dense and expert


def test_offloaded_actor_loads_a_checkpoint_written_without_offload(plain):
    """The checkpoint of the run without offload, loaded into an offloaded worker: the same
    state and the same resumed losses (the two settings share one checkpoint format)."""
    config = loop.worker_config(plain["path"], **SETTINGS, **OFFLOAD)
    worker = loop.new_worker(config, loop.sft_loss_fn())
    worker.load_checkpoint(plain["checkpoint"])
    _assert_equal(_state(worker.engine), plain["state"])
    worker.engine.to("cpu", model=True, optimizer=True, grad=True)
    assert _losses(loop.train_sft(worker, STEPS - SAVE_AT)) == plain["losses"][SAVE_AT:]


def _ref_worker(qwen3, **engine):
    """The reference model as verl builds it: ``forward_only=True``, no DDP."""
    return loop.new_worker(loop.worker_config(qwen3, forward_only=True, **engine), None)


def test_reference_model_param_offload_gives_the_same_log_probs(qwen3):
    """The reference model with ``param_offload=True`` (recipes set it for ``ref``): its
    parameters leave for new host storage after ``initialize()`` and after every
    ``infer_batch`` (the storage they held is freed: real copies), and come back bit for bit:
    the log-probs of two calls equal those of a reference model without offload
    (``torch.equal``)."""
    batch = loop.rollout_batch(0)
    want = loop.old_log_probs(_ref_worker(qwen3), batch)
    worker = _ref_worker(qwen3, param_offload=True)
    before = [p.data for p in engine_model(worker.engine).parameters()]  # the storage held now
    first = loop.old_log_probs(worker, batch)
    assert all(t.untyped_storage().size() == 0 for t in before)  # moved out and freed
    assert all(p.untyped_storage().size() > 0 for p in engine_model(worker.engine).parameters())
    assert torch.equal(first, want)
    assert torch.equal(loop.old_log_probs(worker, batch), want)


def test_verls_own_reference_offload_frees_the_weights_on_a_cpu(qwen3):
    """The control: verl's own ``MegatronEngine.to`` on the CPU reference model (``.to("cpu")``
    is the same storage, then ``resize_(0)``) leaves every parameter without storage."""
    from verl.workers.engine.megatron import MegatronEngineWithLMHead

    engine = _ref_worker(qwen3).engine
    MegatronEngineWithLMHead.to(engine, "cpu", model=True, optimizer=False, grad=False)
    assert all(p.untyped_storage().size() == 0 for p in engine_model(engine).parameters())


# ---------------------------------------------------------------------------------------------
# 2. use_dist_checkpointing: a Megatron distributed checkpoint in TE names
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dist_checkpoint(tmp_path_factory):
    """A Megatron distributed checkpoint of a tiny Qwen3 trained one step through verl, written
    as verl's ``scripts/converter_hf_to_mcore.py`` writes one (``dist_checkpointing.save`` of the
    GPT model's ``sharded_state_dict()``): ``(HF path, checkpoint, parameters, log-probs)``.

    Vocabulary 264: the plugin's trainer (loaded from the same checkpoint below) needs 257+ ids.
    One step, so the weights differ from the Hugging Face files the worker also reads."""
    from megatron.core import dist_checkpointing

    path = loop.save_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3_264"), vocab=264)
    worker = loop.new_worker(loop.worker_config(path, **SETTINGS), loop.sft_loss_fn())
    loop.train_sft(worker, 1)
    gpt = engine_model(worker.engine)
    checkpoint = tmp_path_factory.mktemp("dist_ckpt")
    dist_checkpointing.save(gpt.sharded_state_dict(), str(checkpoint))
    params = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    return path, str(checkpoint), params, infer_log_probs(worker, loop.sft_samples(7)[0])


def _te_disk_keys() -> set[str]:
    """The checkpoint keys of Megatron's TE GPT spec for the tiny Qwen3
    (``specs/param_names_te.yaml``)."""
    from types import SimpleNamespace

    from tests.transformer.te_names import disk_key, expected_names

    config = SimpleNamespace(num_layers=2, normalization="RMSNorm", qk_layernorm=True,
                             num_moe_experts=None, moe_layer_freq=1)  # fmt: skip
    return {disk_key(name, config) for name in expected_names(config, "sharded")}


def _saved_keys(folder) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    return {key.split("/")[0] for key in metadata.state_dict_metadata}  # objects: key/shard_i_n


def test_dist_checkpoint_holds_the_te_spec_names(dist_checkpoint):
    """The checkpoint's keys are exactly Megatron's TE GPT spec's checkpoint keys
    (``specs/param_names_te.yaml``), as a TE-built model writes them."""
    _, checkpoint, _, _ = dist_checkpoint
    assert _saved_keys(checkpoint) == _te_disk_keys()
    print(f"dist checkpoint: {len(_te_disk_keys())} keys, the TE spec's")


def test_verl_worker_loads_the_dist_checkpoint(dist_checkpoint):
    """``use_dist_checkpointing=True`` + ``dist_checkpointing_path`` (verl's
    ``load_mcore_dist_weights`` in ``_build_megatron_module``): the fresh worker holds the saved
    parameters (``torch.equal``) and gives the same log-probs, not those of the HF files."""
    path, checkpoint, params, log_probs = dist_checkpoint
    config = loop.worker_config(path, **SETTINGS, use_dist_checkpointing=True,
                                dist_checkpointing_path=checkpoint)  # fmt: skip
    worker = loop.new_worker(config, loop.sft_loss_fn())
    got = {n: p.detach() for n, p in engine_model(worker.engine).named_parameters()}
    _assert_equal(got, params)
    assert torch.equal(infer_log_probs(worker, loop.sft_samples(7)[0]), log_probs)
    from_hf = loop.new_worker(loop.worker_config(path, **SETTINGS), loop.sft_loss_fn())
    assert not torch.equal(infer_log_probs(from_hf, loop.sft_samples(7)[0]), log_probs)  # control


def test_verl_checkpoint_with_use_dist_checkpointing_resumes_exactly(dist_checkpoint, tmp_path):
    """With ``use_dist_checkpointing=True`` verl's checkpoint manager writes the model as
    Megatron shards (``model/dist_ckpt``, in the TE names) instead of Hugging Face files: a
    fresh worker loads it back to the same state (``torch.equal``) and the next step's loss
    equals the uninterrupted run's (``==``)."""
    path, checkpoint, _, _ = dist_checkpoint
    config = loop.worker_config(path, **SETTINGS, use_dist_checkpointing=True,
                                dist_checkpointing_path=checkpoint)  # fmt: skip
    worker = loop.new_worker(config, loop.sft_loss_fn())
    loop.train_sft(worker, 1)
    state = _state(worker.engine)
    worker.save_checkpoint(str(tmp_path), global_step=1)
    later = _losses(loop.train_sft(worker, 1))
    assert _saved_keys(tmp_path / "model" / "dist_ckpt") == _te_disk_keys()
    fresh = loop.new_worker(config, loop.sft_loss_fn())
    fresh.load_checkpoint(str(tmp_path))
    _assert_equal(_state(fresh.engine), state)
    assert _losses(loop.train_sft(fresh, 1)) == later


def test_plugins_trainer_loads_the_dist_checkpoint_with_init_from(dist_checkpoint):
    """``mcore-npu train``'s ``train.init_from=<folder>`` loads the same checkpoint (a folder
    without ``step_*`` subfolders loads as it is): every parameter equals the saved one, and the
    trainer's model gives verl's logits on the same input."""
    path, checkpoint, params, log_probs = dist_checkpoint
    trainer = loop.own_trainer(path, f"train.init_from={checkpoint}")
    gpt = trainer.model.module.module  # DDP -> Float16Module -> GPTModel
    _assert_equal({n: p.detach() for n, p in gpt.named_parameters()}, params)
    ids = loop.sft_samples(7)[0]
    with torch.no_grad():
        logits = gpt(input_ids=ids[None], position_ids=torch.arange(len(ids))[None],
                     attention_mask=None)[0].float()  # fmt: skip
    own = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
    error = float((own - log_probs[:-1]).abs().max())
    print(f"trainer (init_from) vs verl worker log-probs: max |diff| = {error:.2e}")
    assert error <= 1e-5, error


# ---------------------------------------------------------------------------------------------
# 3. use_dynamic_bsz with a token budget
# ---------------------------------------------------------------------------------------------

TOKEN_BUDGET = 32  # ppo_max_token_len_per_gpu: the 82 tokens of the rollout batch in 3 parts


def _update_grads(worker, batch) -> tuple[dict, list[int], float]:
    """One PPO ``train_mini_batch`` on ``batch``: the fp32 main gradients just before the
    optimizer step (an instance-level spy on ``optimizer_step`` that calls through), the token
    count of every micro-batch the engine ran, and the loss."""
    engine, grads, tokens = worker.engine, {}, []
    step, forward = engine.optimizer_step, engine.forward_step

    def snapshot_then_step():
        grads.update({n: p.main_grad.clone() for n, p in engine_model(engine).named_parameters()})
        return step()

    def counting_forward(batch_iter, *args, **kwargs):
        micro = next(batch_iter)
        tokens.append(int(micro["input_ids"].offsets()[-1]))
        return forward(iter([micro]), *args, **kwargs)

    engine.optimizer_step, engine.forward_step = snapshot_then_step, counting_forward
    metrics = loop.update(worker, batch)
    return (
        grads,
        tokens,
        sum(metrics["loss"]) if isinstance(metrics["loss"], list) else metrics["loss"],
    )


@pytest.mark.parametrize("remove_padding", [True, False], ids=["thd", "bshd"])
def test_dynamic_batch_size_gives_the_gradients_of_fixed_micro_batches(qwen3, remove_padding):
    """The actor's ``use_dynamic_bsz=True`` with ``ppo_max_token_len_per_gpu=32`` (verl's
    engine key ``max_token_len_per_gpu``) regroups the 8 rollout samples (82 tokens) into 3
    micro-batches of at most 32 tokens; fixed micro-batches of 2 samples make 4. Same weights,
    same batch, verl's PPO loss (token-mean over the whole mini-batch): the same gradients,
    up to fp32 summation order (fp32 model: the oracle of ``verl_loop.force_fp32``). Measured
    in the docs (``docs/verl_engine_io.md``)."""
    common = dict(total_steps=4, lr=1e-4, dtype="float32", remove_padding=remove_padding)
    dynamic = dict(use_dynamic_bsz=True, max_token_len_per_gpu=TOKEN_BUDGET,
                   infer_max_token_len_per_gpu=TOKEN_BUDGET)  # fmt: skip
    batch = loop.rollout_batch(0)
    fixed_worker = loop.new_worker(loop.worker_config(qwen3, **common), loop.ppo_loss_fn())
    batch["old_log_probs"] = loop.old_log_probs(fixed_worker, batch)
    batch["advantages"] = loop.grpo_advantages(batch)
    fixed, fixed_tokens, fixed_loss = _update_grads(fixed_worker, batch)
    config = loop.worker_config(qwen3, **common, **dynamic)
    grads, tokens, loss = _update_grads(loop.new_worker(config, loop.ppo_loss_fn()), batch)
    assert len(fixed_tokens) == 4 and len(tokens) == 3, (fixed_tokens, tokens)
    assert sum(tokens) == sum(fixed_tokens) and max(tokens) <= TOKEN_BUDGET, tokens
    assert grads.keys() == fixed.keys()
    scale = max(float(g.abs().max()) for g in fixed.values())
    error = max(float((grads[n] - fixed[n]).abs().max()) for n in fixed)
    layout = "thd" if remove_padding else "bshd"
    print(f"dynamic bsz ({layout}): micro-batch tokens {tokens} vs {fixed_tokens}; "
          f"max |grad diff| {error:.2e} of max |grad| {scale:.2e}; loss {loss} vs {fixed_loss}")  # fmt: skip
    assert scale > 0 and error <= 1e-6 * scale, (error, scale)


# ---------------------------------------------------------------------------------------------
# 4. override_ddp_config.grad_reduce_in_fp32
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override", [{}, {"grad_reduce_in_fp32": False}], ids=["unset", "false"])
def test_grad_reduce_in_fp32_is_honoured(qwen3, override):
    """``megatron.override_ddp_config.grad_reduce_in_fp32`` (recipe 22 sets ``False``) reaches
    Megatron's DDP through verl's ``_resolve_override_ddp_config`` with the plugin's engine:
    unset, verl's default is fp32 gradient buffers (the bf16 model's gradients accumulate and
    reduce in fp32); ``False`` keeps them in bf16. Either trains: finite loss, non-zero norm."""
    config = loop.worker_config(qwen3, **SETTINGS, override_ddp_config=override)
    worker = loop.new_worker(config, loop.sft_loss_fn())
    chunk = worker.engine.module[0]
    want = torch.bfloat16 if override else torch.float32
    assert chunk.ddp_config.grad_reduce_in_fp32 is (not override)
    assert {b.grad_dtype for b in chunk.buffers} == {want}
    assert {p.main_grad.dtype for p in engine_model(worker.engine).parameters()} == {want}
    metrics = loop.train_sft(worker, 2)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    assert all(m["grad_norm"] > 0 for m in metrics)
