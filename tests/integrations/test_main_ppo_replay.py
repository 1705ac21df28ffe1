"""R3 router replay in verl's own trainer on the CPU (``make test-main-ppo-replay``; not in
``make test-verl``: its three ``main_ppo`` launches add about 330 s of CPU, see
docs/router_replay.md). The quick start of ``test_main_ppo.py`` on a tiny Qwen3-MoE with the
public R3 recipe's replay lines (verl-ascend-recipe ``router_replay/run_qwen3_30b_a3b_megatron_npu.sh``):

- ``replay``: R3, the rollout synced, 2 GRPO steps;
- ``no_replay``: the same without ``router_replay.mode`` (the rollout still returns routes);
- ``foreign_routes``: R3 with the rollout ignoring every sync, so it routes with other weights
  than the actor's, 1 step.

Two instruments read each run without changing it: the ``hf_cpu`` rollout's
``MCORE_NPU_HF_CPU_DUMP_DIR`` (each response's ids and routes) and ``route_probe.py`` (each
actor forward's routes), loaded through ``VERL_USE_EXTERNAL_MODULES``.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")

from tests.integrations import main_ppo_run, route_probe

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
# the quick start's lines the replay runs set otherwise
REPLAY_DROPS = ("actor_rollout_ref.model.path=", "actor_rollout_ref.actor.use_kl_loss=",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=")  # fmt: skip


def replay_run(assets, out, *, replay: bool = True, synced: bool = True, steps: int = 2):
    """The quick start on the tiny Qwen3-MoE with the public R3 recipe's replay lines
    (``router_replay.mode=R3``, ``enable_rollout_routing_replay``, ``calculate_log_probs``, thd)
    and its MoE and KL settings (no KL loss, hence no reference model); actor TP=1 (DP=2, one
    sequence a micro-batch), no validation, no checkpoint. The rollout dumps each response's
    routes, the route probe (``route_probe.py``) each actor forward's. ``replay=False``: the same
    run without ``router_replay.mode`` (the rollout still returns routes, which nothing replays);
    ``synced=False``: the rollout ignores every sync, so it routes with other weights than the
    actor's."""
    keep = [o for o in main_ppo_run.recipe(assets, steps=steps, out=out)
            if not o.startswith(REPLAY_DROPS)]  # fmt: skip
    tc = "actor_rollout_ref.actor.megatron.override_transformer_config"
    overrides = [
        *keep,
        f"actor_rollout_ref.model.path={assets.moe_model}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=True",
        f"+{tc}.moe_router_dtype=fp32",
        f"+{tc}.moe_token_dispatcher_type=alltoall",
        f"+{tc}.moe_permute_fusion=False",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
    ]
    if replay:
        overrides.append("actor_rollout_ref.actor.megatron.router_replay.mode=R3")
    env = {"MCORE_NPU_HF_CPU_DUMP_DIR": str(out / "rollout"),
           route_probe.DIR_ENV: str(out / "actor"),
           "VERL_USE_EXTERNAL_MODULES": f"{main_ppo_run.SWITCH['VERL_USE_EXTERNAL_MODULES']},"
                                        "tests.integrations.route_probe",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           **({} if synced else {"MCORE_NPU_HF_CPU_SKIP_SYNC": "1"})}  # fmt: skip
    return overrides, env


RUNS = {
    "replay": replay_run,
    "no_replay": functools.partial(replay_run, replay=False),
    "foreign_routes": functools.partial(replay_run, synced=False, steps=1),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> main_ppo_run.Assets:
    return main_ppo_run.save_assets(tmp_path_factory.mktemp("main_ppo_assets"))


@pytest.fixture(scope="module")
def launches(assets, tmp_path_factory):
    """The three runs, each started once the one before has its Ray instance; at the end
    whatever still runs is killed and its Ray processes reaped."""
    started = {}
    try:
        for name, make in RUNS.items():
            out = tmp_path_factory.mktemp(name)
            overrides, env = make(assets, out)
            started[name] = main_ppo_run.Launch(overrides, out / "run", env)
            started[name].wait_for_ray()
        yield started
    finally:
        for launch in started.values():
            launch.kill()
            launch.result()


def _run_fixture(name: str):
    @pytest.fixture(scope="module", name=name)
    def run(launches) -> main_ppo_run.Result:
        return launches[name].result()

    return run


replay, no_replay, foreign_routes = map(_run_fixture, RUNS)


def _rollout_routes(run: main_ppo_run.Result) -> dict:
    """The rollout's dumps: ``{token ids (prompt + response): routes [P + R - 1, L, k]}``, each
    row's expert ids sorted."""
    import torch

    found = {}
    for file in (run.out.parent / "rollout").glob("routes_*.pt"):
        saved = torch.load(file)
        found[tuple(saved["ids"].tolist())] = saved["routes"].long().sort(dim=-1).values
    return found


def _routes_compared(run: main_ppo_run.Result) -> tuple[int, int, int]:
    """``(actor forwards, rows compared, rows that differ)``: each actor forward's routes (the
    route probe's) against the rollout's for the same sequence, token by token and layer by
    layer, over every token the rollout fed (all but the last: the R3 replay mask's rows). Every
    actor forward must be over one of the rollout's sequences."""
    import torch

    rollout = _rollout_routes(run)
    forwards = [torch.load(f) for f in sorted((run.out.parent / "actor").glob("forward_*.pt"))]
    rows = differ = 0
    for forward in forwards:
        key = tuple(forward["ids"].tolist())
        assert key in rollout, f"an actor forward over a sequence the rollout never sampled: {key}"
        want = rollout[key]  # [T - 1, L, k]
        got = torch.stack(forward["routes"], dim=1)[:-1]  # [T - 1, L, k]
        assert got.shape == want.shape, (got.shape, want.shape)
        rows += got.shape[0] * got.shape[1]
        differ += int((got != want).any(dim=-1).sum())
    return len(forwards), rows, differ


def _assert_replayed(run: main_ppo_run.Result, steps: int) -> None:
    """``steps`` GRPO steps completed; in every actor forward (old log-probs and update) every
    replayed row took the rollout's experts; losses and grad norms finite, grad norms non-zero."""
    main_ppo_run.succeeded(run)
    assert main_ppo_run.trained_steps(run) == list(range(1, steps + 1))
    forwards, rows, differ = _routes_compared(run)
    assert forwards >= 4 * steps and rows > 0, (forwards, rows)  # 4 sequences a step, update
    assert differ == 0, f"{differ} of {rows} replayed rows routed elsewhere"
    for key in ("actor/pg_loss", "actor/grad_norm"):
        values = run.series(key)
        assert len(values) == steps and all(math.isfinite(v) for v in values), (key, values)
    assert all(v > 0 for v in run.series("actor/grad_norm"))


def test_r3_trains_on_the_rollouts_routes(replay):
    """The R3 recipe's lines, the rollout synced: 2 steps on the rollout's routes."""
    _assert_replayed(replay, steps=2)


def test_r3_follows_routes_the_actor_would_not_take(foreign_routes, assets):
    """The rollout ignores every sync, so its routes come from other weights; the actor still
    takes them on every replayed row. The control: the actor's own weights (the checkpoint,
    transformers in fp32) route a quarter or more of those rows elsewhere."""
    import torch
    import transformers

    from mcore_npu.integrations.verl.cpu import routes

    _assert_replayed(foreign_routes, steps=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        assets.moe_model, dtype=torch.float32
    ).eval()
    rows = differ = 0
    for ids, want in _rollout_routes(foreign_routes).items():
        with routes.recording(model) as recorded, torch.no_grad():
            model(input_ids=torch.tensor([ids[:-1]]))
        own = recorded.stacked().long().sort(dim=-1).values
        rows += own.shape[0] * own.shape[1]
        differ += int((own != want).any(dim=-1).sum())
    assert rows > 0 and differ >= rows / 4, (differ, rows)


def test_r3_keeps_the_rollout_probs_no_further_than_without_replay(replay, no_replay):
    """``rollout_probs_diff_max`` with replay is no larger, step by step, than in the same run
    without (same seeds, same prompts)."""
    main_ppo_run.succeeded(no_replay)
    with_replay = replay.series("training/rollout_probs_diff_max")
    without = no_replay.series("training/rollout_probs_diff_max")
    assert len(with_replay) == len(without) == 2, (with_replay, without)
    assert all(a <= b for a, b in zip(with_replay, without)), (with_replay, without)
