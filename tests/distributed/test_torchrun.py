"""Tensor, sequence, pipeline and data parallelism under torchrun (gloo on CPU) against one
process; resharding a tensor-parallel checkpoint into one process; failures that must not hang.

Runs, batches and the shared step-0 checkpoint / one-process run: tests/distributed/runs.py and
conftest.py.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.distributed.runs import BATCH, STEPS
from tests.launch import (
    HANG_TIMEOUT_S,
    ROOT,
    Background,
    Run,
    assert_ok,
    layout_runs,
    max_abs_diff,
    read_metrics,
    reported,
    train,
    train_command,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = {
    "tp2": ["parallel.tensor=2"],
    "tp2_sp": ["parallel.tensor=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pipeline=2"],
    "dp2": [],
}
EXPECTED = {"tp2_sp": (2, 1, True), "pp2": (1, 1, False), "dp2": (1, 2, False)}  # tp, dp, sp
# gpt_tiny as an alltoall MoE over EP=2 (from its own seed: the dense step-0 checkpoint does not
# fit), run on the CPU runtime in the shared launch and on the NPU table in its own
MOE_EP2 = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=128",
           "model.moe_token_dispatcher_type=alltoall", "model.moe_aux_loss_coeff=0.01",
           "parallel.expert=2", *BATCH]  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("torchrun")


@pytest.fixture(scope="module")
def parallel_runs(workdir, initial) -> dict[str, Run]:
    """tp2: a launch of ``mcore-npu train`` of its own (its wall time is the healthy launch the
    failure tests are judged against); the other layouts in one launch, one after another in the
    same processes (``tests.launch.layout_runs``); their ``Run.stdout`` is that launch's."""

    def overrides(name):
        return [*BATCH, *LAYOUTS[name], f"train.init_from={initial}", "train.save_interval=3",
                f"train.checkpoint_dir={workdir / name}"]  # fmt: skip

    runs = {"tp2": assert_ok(train(overrides("tp2"), nproc=2, metrics=workdir / "tp2.jsonl"))}
    shared = [[name, [*overrides(name), "train.progress=false",
                      f"train.metrics_file={workdir / name}.jsonl"]]
              for name in LAYOUTS if name != "tp2"]  # fmt: skip
    shared.append(["moe_ep2", [*MOE_EP2, f"train.metrics_file={workdir / 'moe_ep2'}.jsonl"]])
    stdout = layout_runs("gpt_tiny.yaml", shared, nproc=2)
    for name, _ in shared:
        runs[name] = Run(0, stdout, "", float("nan"), read_metrics(workdir / f"{name}.jsonl"))
    return runs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layout_matches_one_process(layout, single, parallel_runs):
    run = parallel_runs[layout]
    assert len(run.losses) == STEPS
    assert max_abs_diff(run.losses, single.losses) <= 1e-5, (run.losses, single.losses)
    if layout == "tp2":
        assert run.stdout.count("mcore-npu train: done") == 1  # only rank 0 reports
    else:
        had = json.loads(reported(run.stdout, layout, "layout"))
        assert (had["tp"], had["dp"], had["sp"]) == EXPECTED[layout], had


def test_layouts_on_the_npu_table_match_the_cpu_runtime(workdir, initial, single, parallel_runs):
    """The demo trainer's NPU table (mcore_npu.training.npu_calls) in place of the CPU runtime,
    over a CPU-backed torch.npu stand-in (no NPU here): pipeline p2p, tensor-parallel and
    expert-parallel alltoall communication run on it (a CUDA function the table left out raises
    on this CUDA-less torch, as on an NPU without transfer_to_npu; the dispatcher's split sizes,
    which Megatron moves to the host only for is_cuda tensors, reach all_to_all_single as
    numbers), and the losses are one process's (PP, TP) or the CPU runtime's (MoE, EP=2)."""
    planned = [[f"npu_{name}", [*BATCH, *LAYOUTS[name], f"train.init_from={initial}",
                                f"train.metrics_file={workdir / 'npu'}_{name}.jsonl"]]
               for name in ("pp2", "tp2_sp")]  # fmt: skip
    planned.append(
        ["npu_moe_ep2", [*MOE_EP2, f"train.metrics_file={workdir / 'npu_moe_ep2'}.jsonl"]]
    )
    stdout = layout_runs("gpt_tiny.yaml", planned, nproc=2,
                         module="tests.distributed.npu_calls_runs")  # fmt: skip
    for name in ("pp2", "tp2_sp"):
        losses = [m["loss"] for m in read_metrics(workdir / f"npu_{name}.jsonl")]
        assert len(losses) == STEPS
        assert max_abs_diff(losses, single.losses) <= 1e-5, (name, losses, single.losses)
    moe = [read_metrics(workdir / f"{name}.jsonl") for name in ("npu_moe_ep2", "moe_ep2")]
    assert json.loads(reported(stdout, "npu_moe_ep2", "layout"))["ep"] == 2
    assert len(moe[0]) == STEPS and [m["loss"] for m in moe[0]] == [m["loss"] for m in moe[1]]
    calls = json.loads(stdout.split("npu_calls_runs: torch.npu calls: ")[1].splitlines()[0])
    assert calls.get("get_rng_state", 0) > 0, calls
    assert "npu_calls_runs: transfer_to_npu loaded: False" in stdout


def test_tensor_and_sequence_parallel_run_has_the_te_spec_names(workdir, parallel_runs):
    """gpt_tiny.yaml runs in the default TE layout: the TP=2 + SP checkpoint holds exactly the
    names of Megatron's TE spec (specs/param_names_te.yaml), _extra_state entries included."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint import FileSystemReader

    from tests.transformer.te_names import disk_key, expected_names

    config = SimpleNamespace(num_layers=2, normalization="RMSNorm", qk_layernorm=True,
                             num_moe_experts=None, moe_layer_freq=1)  # fmt: skip
    metadata = FileSystemReader(str(workdir / "tp2_sp" / "step_0000003")).read_metadata()
    saved = {key.split("/")[0] for key in metadata.state_dict_metadata}  # objects: key/shard_i_n
    model = {key for key in saved if not key.startswith("optimizer.")}
    assert model == {disk_key(name, config) for name in expected_names(config, "sharded")}


def test_tensor_parallel_checkpoint_resumes_in_one_process(workdir, single, parallel_runs):
    checkpoints = workdir / "tp2"
    (checkpoints / "latest").write_text("step_0000003\n")  # resume from the middle of the run
    run = assert_ok(train([*BATCH, "train.resume=true", f"train.checkpoint_dir={checkpoints}"],
                          metrics=workdir / "resharded.jsonl"))  # fmt: skip
    assert len(run.losses) == STEPS - 3
    assert max_abs_diff(run.losses, single.losses[3:]) <= 1e-5


@pytest.mark.parametrize("kind", ["raise", "exit"])
def test_a_failing_rank_ends_the_launch_quickly_with_its_error(kind, workdir, parallel_runs):
    # The collective timeout is set far beyond the suite's hang guard: the launch can only end
    # in time because torchrun stops the other rank, never because a collective timed out.
    started = time.perf_counter()
    run = train([*BATCH, "parallel.tensor=2", f"train.timeout_s={10 * HANG_TIMEOUT_S:.0f}"],
                nproc=2, module="tests.distributed.faulty_train",
                extra_env={"FAULT_RANK": "1", "FAULT_KIND": kind})  # fmt: skip
    elapsed = time.perf_counter() - started
    assert run.returncode != 0
    # judged against a healthy 2-rank launch measured in this run: no waiting on a dead peer
    assert elapsed < 3 * parallel_runs["tp2"].seconds, (elapsed, parallel_runs["tp2"].seconds)
    output = run.stdout + run.stderr
    if kind == "raise":
        assert "injected failure on rank 1 in step 3" in output
        assert "mcore-npu train: failed on rank 1: RuntimeError" in output
    else:
        assert "exitcode  : 3" in output  # torchrun's report names the dead rank's exit code


def test_bad_config_fails_before_process_groups_with_the_single_process_message(workdir):
    alone = train(["attention.backend=npu"])
    launched = train(["attention.backend=npu"], nproc=2)
    assert alone.returncode == 2 and launched.returncode != 0
    message = alone.stderr.strip().splitlines()[-1]
    assert message.startswith("mcore-npu train: error: config attention.backend='npu'")
    assert message in launched.stderr
    assert "init_process_group" not in launched.stderr


def test_sigterm_to_the_launcher_leaves_a_checkpoint_that_resumes(workdir, initial, parallel_runs):
    """Both ranks pause after step 3; SIGTERM goes to torchrun only (as a scheduler sends it),
    which forwards it; the ranks agree to stop after step 4, save it, and the resumed run's
    losses equal the uninterrupted data-parallel run's."""
    ckpt, metrics, go = workdir / "sigterm", workdir / "sigterm.jsonl", workdir / "sigterm.go"
    cmd, env = train_command(
        [*BATCH, f"train.init_from={initial}", f"train.checkpoint_dir={ckpt}",
         "train.save_interval=3"], nproc=2, metrics=metrics, module="tests.training.signal_train",
        extra_env={"PAUSE_AT_STEP": "3", "PAUSE_UNTIL": str(go)},
    )  # fmt: skip
    with Background(cmd, cwd=ROOT, env=env) as launch:
        launch.wait_for(lambda: (workdir / "sigterm.go.paused").exists(), "the pause")
        launch.signal(signal.SIGTERM)
        time.sleep(0.5)  # let torchrun forward it before the ranks go on
        go.touch()
        done = launch.finish()
    assert "interrupted at step 4 by SIGTERM" in done.stdout, done.stderr[-3000:]
    assert (ckpt / "latest").read_text().strip() == "step_0000004"
    resumed = assert_ok(train([*BATCH, "train.resume=true", f"train.checkpoint_dir={ckpt}"],
                              nproc=2, metrics=metrics))  # fmt: skip
    assert [m["step"] for m in resumed.metrics] == list(range(1, STEPS + 1))
    assert max_abs_diff(resumed.losses, parallel_runs["dp2"].losses) <= 1e-6
