"""verl's own trainer end to end on the CPU: ``python -m verl.trainer.main_ppo`` as a user runs
it, with Ray, TransferQueue, the agent loop, a rule reward, the reference and old log-probs, the
actor update, the weight sync to a rollout every step and verl's checkpoint manager.

The command line is verl's Qwen3-0.6B Ascend quick start (``main_ppo_run.recipe``: GRPO,
``model_engine=megatron``, ``use_flash_attn``, ``trainer.device=npu``, actor and ref at TP=2);
only the rollout name (``hf_cpu``), sizes, batch sizes, lengths, step counts and Ray sizes are
changed. The switch ``VERL_USE_EXTERNAL_MODULES=mcore_npu.integrations.verl.cpu_runtime`` makes
every verl process a CPU process (``mcore_npu.integrations.verl.cpu``). Nothing is mocked: the
stand-ins are the hardware's (gloo for HCCL, the ``hf_cpu`` rollout for vLLM, the project's CPU
shims for torch_npu / CUDA entry points).

Five launches, one subprocess each in its own session (killed as a group on a hang), with its Ray
files in a fresh temp dir; after each, no process of the run may be left:

- ``grpo``: the quick start as written, 3 steps, a checkpoint at step 2;
- ``resumed``: the same command line resuming from that checkpoint (started once it exists);
- ``learning``: 20 steps without the quick start's ``vanilla_mbridge=True`` line (verl's default
  bridge), at a learning rate the tiny model learns with;
- ``critic``: GAE with a Megatron critic, 2 steps, its rollout ignoring every sync (it is also
  the no-sync control);
- ``refused``: a recipe value the plugin refuses.

The R3 router-replay runs are ``test_main_ppo_replay.py`` (``make test-main-ppo-replay``).

They run side by side (``launches``, :func:`_conduct`): each launch spends most of its time
starting Ray actors that import torch, Megatron and verl and leaves the 2 cores half idle alone;
the short runs yield the CPU to the longest chain, grpo then resumed. The module's
wall time is in docs/verl_main_ppo.md.
"""

from __future__ import annotations

import math
import re
import shutil
import threading
import time

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

from tests.integrations import main_ppo_run

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 3
LEARNING_STEPS = 20
# training/rollout_probs_diff_max (verl: max |p_rollout - p_actor| over the response tokens)
# when the sync works: the rollout samples in fp32 from the bf16 weights the actor exports, the
# actor recomputes in bf16 Megatron. Measured on this tiny model: see docs/verl_main_ppo.md; the
# tolerance leaves room above the largest value measured.
SYNC_TOLERANCE = 0.05
ENGINE_LINE = re.compile(r"mcore_npu engine (NPUMegatronEngineWith\w+) on rank (\d) \(([\w ]+)\)")
# the runs that check no checkpoint skip the quick start's save at the last step
NO_SAVE = "trainer.save_freq=-1"
# and the one that checks no validation skips the quick start's before the first and after the
# last step
NO_VALIDATION = ("trainer.test_freq=-1", "trainer.val_before_train=False")
REFUSED_FLAG = "+actor_rollout_ref.actor.megatron.override_transformer_config.use_flash_attn="


def grpo_run(assets, out):
    """The quick start, 3 GRPO steps, a checkpoint at step 2 (with the HF export), the rollout
    server's weights dumped after each sync."""
    overrides = [
        *main_ppo_run.recipe(assets, steps=STEPS, out=out),
        "trainer.save_freq=2",
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
    ]
    return overrides, {"MCORE_NPU_HF_CPU_DUMP_DIR": str(out / "rollout_weights")}


def learning_run(assets, out):
    """The quick start without its ``vanilla_mbridge=True`` line (verl's default bridge,
    Megatron-Bridge, from which the plugin's weight path falls back to mbridge), 20 steps,
    learning rate 2e-3 (the quick start's 5e-7 moves the tiny model nowhere
    in 20 steps). The reward (the share of even-numbered words) is one it can learn."""
    keep = [o for o in main_ppo_run.recipe(assets, steps=LEARNING_STEPS, out=out)
            if "vanilla_mbridge" not in o]  # fmt: skip
    more = ["actor_rollout_ref.actor.optim.lr=2e-3", NO_SAVE]
    return [*keep, *more], {}


def critic_run(assets, out):
    """The same command line with ``algorithm.adv_estimator=gae`` and a Megatron critic (TP=2,
    the plugin's value-head engine), 2 steps, no validation. Its rollout server ignores every sync
    (``MCORE_NPU_HF_CPU_SKIP_SYNC=1``: it samples from its random initial weights), which makes
    it the control of the sync check too."""
    overrides = [
        *(o for o in main_ppo_run.recipe(assets, steps=2, out=out) if "adv_estimator" not in o),
        "algorithm.adv_estimator=gae",
        f"critic.model.path={assets.model}",
        "critic.strategy=megatron",
        "critic.megatron.tensor_model_parallel_size=2",
        "critic.megatron.vanilla_mbridge=True",
        "critic.ppo_micro_batch_size_per_gpu=1",
        "+critic.megatron.override_transformer_config.use_flash_attn=True",
        NO_SAVE,
        *NO_VALIDATION,
    ]
    return overrides, {"MCORE_NPU_HF_CPU_SKIP_SYNC": "1"}


def refused_run(assets, out):
    """The quick start with ``use_flash_attn=False``, a value the plugin refuses."""
    overrides = [o.replace(f"{REFUSED_FLAG}True", f"{REFUSED_FLAG}False")
                 for o in main_ppo_run.recipe(assets, steps=1, out=out)]  # fmt: skip
    return overrides, {}


RUNS = {"grpo": grpo_run, "learning": learning_run, "critic": critic_run, "refused": refused_run}
# the two longest chains (grpo then the run resuming from its checkpoint; the 20 learning steps)
# run at full priority, the short runs yield the CPU to them once their Ray instance is up
YIELDING = {"critic": 10, "refused": 10}
RAY_START_ATTEMPTS = 3  # a run whose Ray instance missed Ray's start-up deadline is relaunched
POLL_S = 0.5


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> main_ppo_run.Assets:
    return main_ppo_run.save_assets(tmp_path_factory.mktemp("main_ppo_assets"))


@pytest.fixture(scope="module")
def launches(assets, tmp_path_factory):
    """Every run of the module, started by a conductor thread (:func:`_conduct`) while the tests
    wait for the ones they read; at the end, whatever still runs (a test failed before waiting
    for it) is killed and its Ray processes reaped."""
    started: dict[str, main_ppo_run.Launch] = {}
    dirs = {name: tmp_path_factory.mktemp(name) for name in [*RUNS, "resumed"]}
    stop = threading.Event()
    conductor = threading.Thread(target=_conduct, args=(started, assets, dirs, stop), daemon=True)
    conductor.start()
    try:
        yield started, conductor
    finally:
        stop.set()
        for launch in list(started.values()):
            launch.kill()  # a killed grpo run also ends the wait for its checkpoint
        conductor.join(timeout=main_ppo_run.HANG_TIMEOUT_S)
        for launch in list(started.values()):
            launch.kill()
            launch.result()


def _conduct(started: dict, assets, dirs: dict, stop: threading.Event) -> None:
    """Start the runs of :data:`RUNS` one after another, each once the one before has its Ray
    instance (no two Ray start-ups compete: Ray gives a raylet 30 s to register, and grpo, the
    first half of the module's longest chain, gets a head start), the runs of :data:`YIELDING`
    then yielding the CPU; then ``resumed`` once grpo has saved its step-2 checkpoint."""
    for name, make in RUNS.items():
        if stop.is_set():
            return
        overrides, env = make(assets, dirs[name])
        for attempt in range(RAY_START_ATTEMPTS):  # Ray's 30 s start-up deadline, on a busy CPU
            out = dirs[name] / ("run" if attempt == 0 else f"run_retry{attempt}")
            launch = started[name] = main_ppo_run.Launch(overrides, out, env)
            launch.wait_for_ray()
            if not launch.ray_start_timed_out():
                break
            launch.result()  # ended: reap what it left and drop its Ray dir
        if name in YIELDING:
            launch.yield_cpu(YIELDING[name])
    if _saved_step_2(started["grpo"], stop):
        started["resumed"] = _resume(started["grpo"], assets, dirs["resumed"])


def _saved_step_2(grpo: main_ppo_run.Launch, stop: threading.Event) -> bool:
    """Wait until the tracker file of grpo's checkpoints says 2 or 3 (verl writes it once a
    checkpoint is complete); False if grpo ended or the module stopped first."""
    tracker = grpo.out.parent / "checkpoints" / "latest_checkpointed_iteration.txt"
    while not (tracker.is_file() and tracker.read_text().strip() in ("2", "3")):
        if stop.is_set() or not grpo.running():
            return tracker.is_file() and tracker.read_text().strip() in ("2", "3")
        time.sleep(POLL_S)
    return True


def _resume(grpo: main_ppo_run.Launch, assets, out) -> main_ppo_run.Launch:
    """The quick start again with ``trainer.resume_mode=auto``, in a fresh checkpoint folder
    holding a copy of grpo's step-2 checkpoint and a tracker file saying 2: it resumes at step 2
    and runs step 3."""
    source, target = grpo.out.parent / "checkpoints", out / "checkpoints"
    shutil.copytree(source / "global_step_2", target / "global_step_2")
    (target / "latest_checkpointed_iteration.txt").write_text("2")
    overrides = [*main_ppo_run.recipe(assets, steps=STEPS, out=out), "trainer.resume_mode=auto"]
    return main_ppo_run.Launch(overrides, out / "run")


def _result(launches, name: str) -> main_ppo_run.Result:
    """Run ``name``'s result, once the conductor has started it and it has ended."""
    started, conductor = launches
    while name not in started and conductor.is_alive():
        time.sleep(POLL_S)
    assert name in started, f"the {name} run was never started (see the conductor's error)"
    return started[name].result()


def _run_fixture(name: str):
    """The module fixture ``name``: that run's :class:`main_ppo_run.Result`."""

    @pytest.fixture(scope="module", name=name)
    def run(launches) -> main_ppo_run.Result:
        return _result(launches, name)

    return run


grpo, learning, critic, refused, resumed = map(
    _run_fixture, ("grpo", "learning", "critic", "refused", "resumed")
)


def _engines(run: main_ppo_run.Result) -> set[tuple[str, str, str]]:
    """``(engine class, rank, role)`` of each engine the workers logged building."""
    return set(ENGINE_LINE.findall(run.output))


def test_three_grpo_steps_complete(grpo):
    main_ppo_run.succeeded(grpo)
    assert main_ppo_run.trained_steps(grpo) == list(range(1, STEPS + 1))


def test_greedy_validation_runs_before_the_first_step_and_after_the_last(grpo):
    """The quick start's ``test_freq`` and verl's default ``val_before_train``: the validation
    set is generated greedily (``temperature=0``) and scored at step 0 and step 3."""
    rows = {m["step"]: [k for k in m["data"] if k.startswith("val-core/")] for m in grpo.metrics}
    assert rows.get(0) and rows.get(STEPS), rows


def test_the_plugin_engine_runs_in_every_actor_and_ref_worker(grpo):
    """Read from the workers' own log lines (forwarded to main_ppo's output): both TP ranks
    built the plugin's LM-head engine for the actor (training) and for the reference (forward
    only)."""
    assert _engines(grpo) == {("NPUMegatronEngineWithLMHead", str(rank), role)
                              for rank in (0, 1) for role in ("training", "forward only")}  # fmt: skip


@pytest.mark.parametrize("key", ["critic/score/mean", "actor/pg_loss", "actor/kl_loss"])
def test_reward_and_losses_are_finite_at_every_step(grpo, key):
    values = grpo.series(key)
    assert len(values) == STEPS, f"{key}: {values}"
    assert all(math.isfinite(v) for v in values), f"{key}: {values}"


def test_the_policy_loss_is_not_zero_by_symmetry(grpo):
    """Responses end at different lengths (the tiny model samples its end-of-turn token), so
    GRPO's token-mean policy loss is a real number, not the 0 of equal-length groups."""
    assert any(v != 0.0 for v in grpo.series("actor/pg_loss")), grpo.series("actor/pg_loss")
    lengths = grpo.series("response_length/min") + grpo.series("response_length/max")
    assert min(lengths) < max(lengths), lengths


def test_rollout_probs_match_the_actor_after_each_sync(grpo):
    diffs = grpo.series("training/rollout_probs_diff_max")
    assert len(diffs) == STEPS
    assert max(diffs) < SYNC_TOLERANCE, diffs


def test_a_run_without_sync_exceeds_the_tolerance_tenfold(critic):
    main_ppo_run.succeeded(critic)
    diffs = critic.series("training/rollout_probs_diff_max")  # measured: 0.598, 0.339
    assert len(diffs) == 2 and diffs[0] >= 10 * SYNC_TOLERANCE, diffs


def test_rollout_weights_after_step_2_equal_the_actor_export(grpo):
    """The server's weights after the sync that follows step 2's update (dumped with verl's
    step counter then, 2) equal, tensor for tensor, the actor's Hugging Face export in the
    step-2 checkpoint (bf16, read as fp32)."""
    import torch
    from safetensors.torch import load_file

    main_ppo_run.succeeded(grpo)
    dumps = grpo.out.parent / "rollout_weights"
    rollout = load_file(dumps / "replica0_step2.safetensors")
    export_dir = grpo.out.parent / "checkpoints" / "global_step_2" / "actor"
    files = sorted(export_dir.rglob("*.safetensors"))
    assert files, f"no HF export under {export_dir}"
    exported = {}
    for file in files:
        exported.update(load_file(file))
    assert set(exported) == set(rollout)
    for name, tensor in exported.items():
        assert torch.equal(rollout[name], tensor.float()), name
    first = load_file(dumps / "replica0_step0.safetensors")  # the first sync: weights moved
    assert any(not torch.equal(first[name], rollout[name]) for name in rollout)


def test_resume_at_step_2_gives_the_same_step_3(grpo, resumed):
    """bf16 as the recipe runs (verl refuses an fp32 actor); every source of randomness is
    seeded (the rollout's per-request streams, verl's data order): step 3 of the resumed run
    equals the uninterrupted run's within 1e-6."""
    main_ppo_run.succeeded(resumed)
    assert main_ppo_run.trained_steps(resumed) == [3]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"):
        (again,) = resumed.series(key)
        assert again == pytest.approx(grpo.series(key)[2], abs=1e-6), key


def test_without_the_vanilla_mbridge_line(learning):
    """verl's default bridge: the plugin's engines build and the export reaches the rollout."""
    main_ppo_run.succeeded(learning)
    built = {(engine, role) for engine, _, role in _engines(learning)}
    assert built == {("NPUMegatronEngineWithLMHead", "training"),
                     ("NPUMegatronEngineWithLMHead", "forward only")}  # fmt: skip
    diffs = learning.series("training/rollout_probs_diff_max")
    assert len(diffs) == LEARNING_STEPS and max(diffs) < SYNC_TOLERANCE, diffs


def test_it_learns(learning):
    """Seed fixed: the mean reward of the last 5 of 20 steps is higher than at step 1, and the
    greedy validation's after step 20 higher than before step 1."""
    main_ppo_run.succeeded(learning)
    scores = learning.series("critic/score/mean")
    assert len(scores) == LEARNING_STEPS, scores
    assert sum(scores[-5:]) / 5 > scores[0], scores
    validation = {m["step"]: v for m in learning.metrics for k, v in m["data"].items()
                  if k.startswith("val-core/") and k.endswith("/mean@1")}  # fmt: skip
    assert validation[LEARNING_STEPS] > validation[0], validation


def test_a_refused_key_ends_the_run_with_the_plugins_message(refused):
    """A non-zero exit, the plugin's one-line refusal in main_ppo's own output, no process
    left."""
    assert refused.returncode != 0
    lines = [line for line in refused.output.splitlines() if "ValueError" in line]
    assert any("use_flash_attn" in line and "npu_fusion_attention" in line for line in lines), (
        lines[-5:]
    )
    assert refused.leftovers == [], refused.leftovers


def test_a_critic_with_gae_runs_on_the_value_head_engine(critic):
    main_ppo_run.succeeded(critic)
    built = {(engine, rank) for engine, rank, _ in _engines(critic)}
    assert {
        ("NPUMegatronEngineWithValueHead", "0"),
        ("NPUMegatronEngineWithValueHead", "1"),
    } <= built
    (vf_loss,) = {k for m in critic.metrics for k in m["data"] if k.endswith("vf_loss")}
    for key in (vf_loss, "actor/pg_loss"):
        values = critic.series(key)
        assert len(values) == 2 and all(math.isfinite(v) for v in values), (key, values)
