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

pytestmark = pytest.mark.usefixtures("cpu_runtime")

SETTINGS = {"total_steps": 4, "lr": 2e-3}
STEPS, SAVE_AT = 4, 2
OFFLOAD = {"param_offload": True, "optimizer_offload": True}


def _losses(metrics) -> list[float]:
    return [m["loss"] for m in metrics]


def _gpt(engine):
    model = engine.module[0]
    while not hasattr(model, "decoder"):
        model = model.module
    return model


def _state(engine) -> dict[str, torch.Tensor]:
    """Clones of the model parameters, the fp32 main parameters and every Adam state tensor
    (moments and step), by name / position. The engine is loaded onto the device first."""
    engine.to(get_device_name(), model=True, optimizer=True, grad=True)
    out = {f"param.{n}": p.detach().clone() for n, p in _gpt(engine).named_parameters()}
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
    """verl's param offload frees the DDP parameter buffer's storage between calls."""
    return all(b.param_data.untyped_storage().size() == 0 for b in engine.module[0].buffers)


@pytest.fixture(scope="module")
def plain(qwen3, tmp_path_factory):
    """4 SFT steps without offload: the losses, the full state after step 2 and the checkpoint
    verl writes there."""
    worker = loop.new_worker(loop.worker_config(qwen3, **SETTINGS), loop.sft_loss_fn())
    losses = _losses(loop.train_sft(worker, SAVE_AT))
    state = _state(worker.engine)
    checkpoint = tmp_path_factory.mktemp("plain")
    worker.save_checkpoint(str(checkpoint), global_step=SAVE_AT)
    losses += _losses(loop.train_sft(worker, STEPS - SAVE_AT))
    return {"losses": losses, "state": state, "checkpoint": str(checkpoint)}


# ---------------------------------------------------------------------------------------------
# 1. param_offload / optimizer_offload
# ---------------------------------------------------------------------------------------------


def test_actor_offload_trains_saves_and_loads_bit_exactly(qwen3, plain, tmp_path):
    """Actor with ``param_offload`` and ``optimizer_offload``: each step's loss equals the
    run without offload (``==``), so does the whole state after step 2 (``torch.equal``); its
    checkpoint, loaded into a fresh offloaded worker, restores that state bit for bit and the
    resumed steps 3-4 give the same losses."""
    config = loop.worker_config(qwen3, **SETTINGS, **OFFLOAD)
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


def test_offloaded_actor_loads_a_checkpoint_written_without_offload(qwen3, plain):
    """The checkpoint of the run without offload, loaded into an offloaded worker: the same
    state and the same resumed losses (the two settings share one checkpoint format)."""
    worker = loop.new_worker(loop.worker_config(qwen3, **SETTINGS, **OFFLOAD), loop.sft_loss_fn())
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
    ``infer_batch``, and come back bit for bit: the log-probs of two calls equal those of a
    reference model without offload (``torch.equal``)."""
    batch = loop.rollout_batch(0)
    want = loop.old_log_probs(_ref_worker(qwen3), batch)
    worker = _ref_worker(qwen3, param_offload=True)
    pointers = [p.data_ptr() for p in _gpt(worker.engine).parameters()]
    first = loop.old_log_probs(worker, batch)
    moved = [p.data_ptr() for p in _gpt(worker.engine).parameters()]
    assert all(a != b for a, b in zip(pointers, moved, strict=True))  # real copies
    assert torch.equal(first, want)
    assert torch.equal(loop.old_log_probs(worker, batch), want)


def test_verls_own_reference_offload_frees_the_weights_on_a_cpu(qwen3):
    """The control: verl's own ``MegatronEngine.to`` on the CPU reference model (``.to("cpu")``
    is the same storage, then ``resize_(0)``) leaves every parameter without storage."""
    from verl.workers.engine.megatron import MegatronEngineWithLMHead

    engine = _ref_worker(qwen3).engine
    MegatronEngineWithLMHead.to(engine, "cpu", model=True, optimizer=False, grad=False)
    assert all(p.untyped_storage().size() == 0 for p in _gpt(engine).parameters())
