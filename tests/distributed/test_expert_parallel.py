"""Expert parallelism under torchrun (gloo on CPU) against one process, with the MoE demo model
(configs/gpt_tiny_moe.yaml: 4 experts, top-2, NPUGroupedMLP on the grouped-matmul reference).

EP=2 on 2 ranks with Megatron's alltoall and allgather token dispatchers, EP=2 on 4 ranks
(expert data parallel 2, dense data parallel 4), and EP=2 x TP=2 on 4 ranks (sequence parallel,
expert TP 2, alltoall dispatcher: its tensor-parallel token gather has unequal chunks, which gloo
gathers through ``cpu_support.UnevenGatherOnGloo``). Every layout starts from the same weights
without a checkpoint: NPUGroupedMLP draws all global experts' weights on every rank
(``use_cpu_initialization``) and keeps its own. The layouts of one world size share one launch,
one after another in the same processes (``tests.launch.layout_runs``).
"""

from __future__ import annotations

import json

import pytest

from tests.launch import assert_ok, layout_runs, max_abs_diff, read_metrics, reported, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CONFIG = "gpt_tiny_moe.yaml"
STEPS = 4
BATCH = ["train.micro_batch_size=1", "train.global_batch_size=4", f"train.steps={STEPS}",
         "train.seq_length=64"]  # fmt: skip
LAYOUTS = {  # name: (processes, overrides)
    "ep2_alltoall": (2, ["parallel.expert=2"]),
    "ep2_allgather": (2, ["parallel.expert=2", "model.moe_token_dispatcher_type=allgather"]),
    "ep2_dp2": (4, ["parallel.expert=2"]),
    "ep2_tp2": (4, ["parallel.expert=2", "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    # the fused MoE permute (its reference) through the trainer's YAML key
    "ep2_fused_permute": (2, ["parallel.expert=2", "fused.moe_permute=reference"]),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("ep")


@pytest.fixture(scope="module")
def single(workdir):
    return assert_ok(train(BATCH, config=CONFIG, metrics=workdir / "single.jsonl"))


@pytest.fixture(scope="module")
def parallel(workdir) -> dict[str, tuple[list[float], dict]]:
    """``name -> (losses, the layout Megatron's parallel state had)``: the layouts of each world
    size in one launch (``tests.launch.layout_runs``), one after another in the same processes."""
    stdout = {}
    for nproc in sorted({nproc for nproc, _ in LAYOUTS.values()}):
        planned = [[name, [*BATCH, *overrides, "train.progress=false",
                           f"train.metrics_file={workdir / name}.jsonl"]]
                   for name, (size, overrides) in LAYOUTS.items() if size == nproc]  # fmt: skip
        stdout.update(dict.fromkeys((name for name, _ in planned),
                                    layout_runs(CONFIG, planned, nproc=nproc)))  # fmt: skip
    return {name: ([m["loss"] for m in read_metrics(workdir / f"{name}.jsonl")],
                   json.loads(reported(stdout[name], name, "layout"))) for name in LAYOUTS}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_losses_match_one_process(layout, single, parallel):
    losses, had = parallel[layout]
    nproc, _ = LAYOUTS[layout]
    tp = 2 if layout == "ep2_tp2" else 1
    assert (had["ep"], had["tp"], had["dp"]) == (2, tp, nproc // tp), had
    assert len(losses) == STEPS == len(single.losses)
    assert max_abs_diff(losses, single.losses) <= 1e-5, (losses, single.losses)
    assert single.losses[-1] < single.losses[0]  # the model learns, so the steps differ


def test_an_expert_parallel_checkpoint_loads_in_one_process_and_in_ep2(tmp_path, single):
    """EP=2 saves a step-0 checkpoint (seed 99: weights unlike the default seed's); one process
    and EP=2 both start from it and must agree with each other, and differ from ``single``.
    The EP=2 save and the EP=2 run from it share one launch."""
    init = tmp_path / "init"
    start = [*BATCH, f"train.init_from={init}", "train.progress=false"]
    layout_runs(CONFIG, [
        ["init", ["train.steps=0", "train.seed=99", f"train.checkpoint_dir={init}",
                  "parallel.expert=2", "train.progress=false"]],
        ["ep2", [*start, "parallel.expert=2", f"train.metrics_file={tmp_path / 'ep2.jsonl'}"]],
    ], nproc=2)  # fmt: skip
    one = assert_ok(train(start, config=CONFIG, metrics=tmp_path / "one.jsonl"))
    ep2 = [m["loss"] for m in read_metrics(tmp_path / "ep2.jsonl")]
    assert len(ep2) == STEPS
    assert max_abs_diff(ep2, one.losses) <= 1e-5, (ep2, one.losses)
    assert abs(one.losses[0] - single.losses[0]) > 1e-4  # the checkpoint's weights were used
