"""``mcore-npu train`` with context parallelism under torchrun (gloo) against one process.

Every run starts from the shared step-0 checkpoint and is compared with the shared one-process
run (tests/distributed/runs.py: 6 steps of 4 samples of 128 tokens). Each CP=2 comm type,
CP=2 x TP=2 (4 ranks), CP=2 with packed sequences, and a CP=2 checkpoint resumed in one process
must reproduce the one-process losses within 1e-5. The 2-rank runs share one launch, one after
another in the same processes (``tests.launch.layout_runs``); nothing carries over from one run
to the next, or the later ones would leave the one-process losses.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.runs import BATCH, STEPS
from tests.launch import assert_ok, layout_runs, max_abs_diff, read_metrics, reported, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

LAYOUTS = {
    "cp2_p2p": (2, ["parallel.cp_comm_type=p2p"]),
    "cp2_all_gather": (2, ["parallel.cp_comm_type=all_gather"]),
    "cp2_a2a": (2, ["parallel.cp_comm_type=a2a"]),
    "cp2_tp2": (4, ["parallel.tensor=2"]),
    # packed (thd) rows split per sequence; every row is a full sequence, so the one-process
    # packed run is the unpacked one (bit-identical when measured): `single` is its reference
    "cp2_packed_p2p": (2, ["parallel.cp_comm_type=p2p", "data.pack_sequences=true"]),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("cp")


@pytest.fixture(scope="module")
def runs(workdir, initial) -> dict[str, tuple[list[float], dict]]:
    """``name -> (losses, the layout Megatron's parallel state had)``: the runs of each world
    size in one launch (``tests.launch.layout_runs``), one after another in the same processes."""
    stdout = {}
    for nproc in sorted({nproc for nproc, _ in LAYOUTS.values()}):
        planned = [[name, [*BATCH, *layout, f"train.init_from={initial}", "train.progress=false",
                           f"train.checkpoint_dir={workdir / name}", "train.save_interval=3",
                           f"train.metrics_file={workdir / name}.jsonl"]]
                   for name, (size, layout) in LAYOUTS.items() if size == nproc]  # fmt: skip
        stdout.update(dict.fromkeys((name for name, _ in planned),
                                    layout_runs("gpt_tiny_cp2.yaml", planned, nproc=nproc)))  # fmt: skip
    return {name: ([m["loss"] for m in read_metrics(workdir / f"{name}.jsonl")],
                   json.loads(reported(stdout[name], name, "layout"))) for name in LAYOUTS}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_matches_one_process(layout, single, runs):
    losses, parallel = runs[layout]
    assert (parallel["cp"], parallel["tp"]) == (2, 2 if layout == "cp2_tp2" else 1), parallel
    assert len(losses) == STEPS
    assert max_abs_diff(losses, single.losses) <= 1e-5, (losses, single.losses)


def test_context_parallel_checkpoint_resumes_in_one_process(workdir, single, runs):
    checkpoints = workdir / "cp2_p2p"
    assert (checkpoints / "step_0000003").is_dir()
    (checkpoints / "latest").write_text("step_0000003\n")  # resume from the middle of the run
    run = assert_ok(train([*BATCH, "train.resume=true", f"train.checkpoint_dir={checkpoints}",
                           "parallel.context=1"], metrics=workdir / "resumed.jsonl"))  # fmt: skip
    assert len(run.losses) == STEPS - 3
    assert max_abs_diff(run.losses, single.losses[3:]) <= 1e-5, (run.losses, single.losses)
