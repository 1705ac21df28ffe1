"""Expert biases (``model.add_bias_linear=true``) under expert parallelism: EP=2 on 2 ranks
(torchrun, gloo on CPU) against one process, with the MoE demo model (configs/gpt_tiny_moe.yaml,
NPUGroupedMLP on the grouped-matmul reference). The biases start at zero, as Megatron's do; the
optimizer moves them from the first step on, so the later steps' losses depend on them."""

from __future__ import annotations

import pytest

from tests.launch import assert_ok, max_abs_diff, train

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
BATCH = ["train.micro_batch_size=1", "train.global_batch_size=4", f"train.steps={STEPS}",
         "train.seq_length=64", "model.add_bias_linear=true"]  # fmt: skip


def test_expert_biases_under_expert_parallelism_match_one_process(tmp_path):
    single = assert_ok(train(BATCH, config="gpt_tiny_moe.yaml", metrics=tmp_path / "one.jsonl"))
    ep2 = assert_ok(train([*BATCH, "parallel.expert=2"], config="gpt_tiny_moe.yaml", nproc=2,
                          metrics=tmp_path / "ep2.jsonl"))  # fmt: skip
    assert len(ep2.losses) == STEPS == len(single.losses)
    assert max_abs_diff(ep2.losses, single.losses) <= 1e-5, (ep2.losses, single.losses)
    assert single.losses[-1] < single.losses[0]
