"""Expert parallelism under torchrun (gloo on CPU) against one process, with the MoE demo model
(configs/gpt_tiny_moe.yaml: 4 experts, top-2, NPUGroupedMLP on the grouped-matmul reference).

EP=2 on 2 ranks with Megatron's alltoall and allgather token dispatchers, EP=2 on 4 ranks
(expert data parallel 2, dense data parallel 4), and EP=2 x TP=2 on 4 ranks (sequence parallel,
expert TP 2, alltoall dispatcher: its tensor-parallel token gather has unequal chunks, which gloo
gathers through ``cpu_support.UnevenGatherOnGloo``). Every layout starts from the same weights
without a checkpoint: NPUGroupedMLP draws all global experts' weights on every rank
(``use_cpu_initialization``) and keeps its own.
"""

from __future__ import annotations

import pytest

from tests.launch import assert_ok, max_abs_diff, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

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
def single(tmp_path_factory):
    path = tmp_path_factory.mktemp("ep") / "single.jsonl"
    return assert_ok(train(BATCH, config="gpt_tiny_moe.yaml", metrics=path))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_losses_match_one_process(layout, single, tmp_path):
    nproc, overrides = LAYOUTS[layout]
    run = assert_ok(train([*BATCH, *overrides], config="gpt_tiny_moe.yaml", nproc=nproc,
                          metrics=tmp_path / f"{layout}.jsonl"))  # fmt: skip
    assert len(run.losses) == STEPS == len(single.losses)
    assert max_abs_diff(run.losses, single.losses) <= 1e-5, (run.losses, single.losses)
    assert single.losses[-1] < single.losses[0]  # the model learns, so the steps differ
    assert run.stdout.count("mcore-npu train: done") == 1


def test_an_expert_parallel_checkpoint_loads_in_one_process_and_in_ep2(tmp_path, single):
    """EP=2 saves a step-0 checkpoint (seed 99: weights unlike the default seed's); one process
    and EP=2 both start from it and must agree with each other, and differ from ``single``."""
    init = tmp_path / "init"
    assert_ok(train(["train.steps=0", "train.seed=99", f"train.checkpoint_dir={init}",
                     "parallel.expert=2"], config="gpt_tiny_moe.yaml", nproc=2))  # fmt: skip
    start = [*BATCH, f"train.init_from={init}"]
    one = assert_ok(train(start, config="gpt_tiny_moe.yaml", metrics=tmp_path / "one.jsonl"))
    ep2 = assert_ok(train([*start, "parallel.expert=2"], config="gpt_tiny_moe.yaml", nproc=2,
                          metrics=tmp_path / "ep2.jsonl"))  # fmt: skip
    assert max_abs_diff(ep2.losses, one.losses) <= 1e-5, (ep2.losses, one.losses)
    assert abs(one.losses[0] - single.losses[0]) > 1e-4  # the checkpoint's weights were used
