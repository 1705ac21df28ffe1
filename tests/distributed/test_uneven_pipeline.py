"""Uneven pipeline stages under torchrun (gloo on CPU) against one process.

configs/gpt_tiny_pp_uneven.yaml (6 layers) at PP=2 and PP=4, with uneven first and last stages,
given as the trainer's ``parallel.first_stage_layers`` / ``last_stage_layers`` and as MindSpeed's
``parallel.pipeline_num_transformer_layers``. The PP=4 list is one that first/last counts cannot
express, so it reaches Megatron as ``pipeline_model_parallel_layout``; the other three reach it as
``num_layers_in_first/last_pipeline_stage``. Every run loads the same step-0 checkpoint
(a 2- or 4-stage model does not start from a 1-stage one's weights otherwise).
"""

from __future__ import annotations

import pytest

from tests.distributed.runs import BATCH, STEPS
from tests.launch import assert_ok, max_abs_diff, train

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
def uneven_initial(workdir):
    """The step-0 checkpoint of the 6-layer model, saved by one process."""
    assert_ok(train(["parallel.pipeline=1", *NO_COUNTS, "train.steps=0",
                     f"train.checkpoint_dir={workdir / 'init'}"], config=CONFIG))  # fmt: skip
    return workdir / "init"


@pytest.fixture(scope="module")
def uneven_single(workdir, uneven_initial):
    return assert_ok(train(["parallel.pipeline=1", *NO_COUNTS, *BATCH,
                            f"train.init_from={uneven_initial}"], config=CONFIG,
                           metrics=workdir / "single.jsonl"))  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_uneven_stages_match_one_process(name, workdir, uneven_initial, uneven_single):
    nproc, overrides, stages = LAYOUTS[name]
    run = assert_ok(train([*BATCH, *overrides, f"train.init_from={uneven_initial}"],
                          config=CONFIG, nproc=nproc, metrics=workdir / f"{name}.jsonl",
                          module="tests.distributed.stage_train"))  # fmt: skip
    assert len(run.losses) == STEPS
    assert max_abs_diff(run.losses, uneven_single.losses) <= 1e-5, (
        run.losses,
        uneven_single.losses,
    )
    # the layers sit where the config put them (1-based layer numbers, printed by every stage)
    first = [sum(stages[:rank]) + 1 for rank in range(nproc)]
    for rank, (start, count) in enumerate(zip(first, stages)):
        layers = list(range(start, start + count))
        assert f"pipeline stage {rank}: decoder layers {layers}" in run.stdout, run.stdout[-2000:]
