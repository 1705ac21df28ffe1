"""Uneven pipeline stages under torchrun (gloo on CPU) against one process.

configs/gpt_tiny_pp_uneven.yaml (6 layers) at PP=2 and PP=4, with uneven first and last stages,
given as the trainer's ``parallel.first_stage_layers`` / ``last_stage_layers`` and as MindSpeed's
``parallel.pipeline_num_transformer_layers``. The PP=4 list is one that first/last counts cannot
express, so it reaches Megatron as ``pipeline_model_parallel_layout``; the other three reach it as
``num_layers_in_first/last_pipeline_stage``. Every run loads the same step-0 checkpoint
(a 2- or 4-stage model does not start from a 1-stage one's weights otherwise). The runs of each
world size share one launch (``tests.launch.layout_runs``, which prints each stage's layers).
"""

from __future__ import annotations

import sys

import pytest

from tests.distributed.runs import BATCH, STEPS
from tests.launch import layout_runs, max_abs_diff, read_metrics, reported

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CONFIG = "gpt_tiny_pp_uneven.yaml"
NO_COUNTS = ["parallel.first_stage_layers=null", "parallel.last_stage_layers=null"]
LAYOUTS = {  # name -> (processes, overrides, layers per stage)
    "pp2_first_last": (2, ["parallel.pipeline=2", "parallel.first_stage_layers=2",
                           "parallel.last_stage_layers=4"], [2, 4]),
    "pp2_list": (2, ["parallel.pipeline=2", *NO_COUNTS,
                     "parallel.pipeline_num_transformer_layers=[[4],[2]]"], [4, 2]),
    "pp4_first_last": (4, [], [1, 2, 2, 1]),  # the config's own: first 1, last 1
    "pp4_list": (4, [*NO_COUNTS, "parallel.pipeline_num_transformer_layers=[[1],[2],[1],[2]]"],
                 [1, 2, 1, 2]),
}  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("uneven")


@pytest.fixture(scope="module")
def uneven_single(workdir) -> list[float]:
    """The losses of one process from the step-0 checkpoint of the 6-layer model, which the
    same launch saves first (``workdir/init``)."""
    one = ["parallel.pipeline=1", *NO_COUNTS, "train.progress=false"]
    layout_runs(CONFIG, [
        ["init", [*one, "train.steps=0", f"train.checkpoint_dir={workdir / 'init'}"]],
        ["single", [*one, *BATCH, f"train.init_from={workdir / 'init'}",
                    f"train.metrics_file={workdir / 'single.jsonl'}"]],
    ])  # fmt: skip
    return [m["loss"] for m in read_metrics(workdir / "single.jsonl")]


@pytest.fixture(scope="module")
def uneven_runs(workdir, uneven_single) -> dict[str, str]:
    """``name -> stdout`` of its launch: the layouts of each world size in one launch
    (``tests.launch.layout_runs``), one after another in the same processes."""
    stdout = {}
    for nproc in sorted({nproc for nproc, _, _ in LAYOUTS.values()}):
        planned = [[name, [*BATCH, *overrides, f"train.init_from={workdir / 'init'}",
                           "train.progress=false", f"train.metrics_file={workdir / name}.jsonl"]]
                   for name, (size, overrides, _) in LAYOUTS.items() if size == nproc]  # fmt: skip
        stdout.update(dict.fromkeys((name for name, _ in planned),
                                    layout_runs(CONFIG, planned, nproc=nproc)))  # fmt: skip
    return stdout


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_uneven_stages_match_one_process(name, workdir, uneven_single, uneven_runs):
    nproc, _, stages = LAYOUTS[name]
    losses = [m["loss"] for m in read_metrics(workdir / f"{name}.jsonl")]
    assert len(losses) == STEPS
    error = max_abs_diff(losses, uneven_single)
    print(f"{name}: max |loss - one process| over {STEPS} steps = {error:.1e}", file=sys.stderr)
    assert error <= 1e-5, (losses, uneven_single)
    # the layers sit where the config put them (1-based layer numbers, one line per stage)
    first = [sum(stages[:rank]) + 1 for rank in range(nproc)]
    for rank, (start, count) in enumerate(zip(first, stages, strict=True)):
        layers = list(range(start, start + count))
        assert reported(uneven_runs[name], name, f"stage {rank} layers") == str(layers)
