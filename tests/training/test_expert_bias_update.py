"""``mcore-npu train`` with the DeepSeek-V3 MoE layer: the expert bias moves as Megatron's
``finalize_model_grads`` moves it, and multi-token prediction is built.

One real training run in a child process (``tests/training/router_train.py``: the real trainer,
which prints what the update saw): a dense first layer, then an MoE layer with a sigmoid router,
expert bias, group-limited top-k, top-k scaling and gated shared experts, and one MTP layer
(which holds an MoE layer too, so its router is updated as well). After every step each bias
must equal ``b + rate * sign(mean(c) - c)`` of the counts ``c`` its router saw that step
(DeepSeek-V3's auxiliary-loss-free balancing, which Megatron's ``get_updated_expert_bias``
implements; the run has one process, so the all-reduced counts are the local ones).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.launch import assert_ok, train
from tests.megatron_features import needs_fields

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only,
              needs_fields("moe_shared_expert_gate", feature="DeepSeek-V3's gated shared experts")]  # fmt: skip

RATE = 0.01
DEEPSEEK = [
    "model.num_moe_experts=8", "model.moe_router_topk=2", "model.moe_router_num_groups=2",
    "model.moe_router_group_topk=1", "model.moe_router_score_function=sigmoid",
    "model.moe_router_enable_expert_bias=true", f"model.moe_router_bias_update_rate={RATE}",
    "model.moe_router_topk_scaling_factor=2.5", "model.moe_router_load_balancing_type=none",
    "model.moe_aux_loss_coeff=0.0", "model.moe_shared_expert_intermediate_size=64",
    "model.moe_shared_expert_gate=true", "model.moe_layer_freq=[0,1]", "model.mtp_num_layers=1",
]  # fmt: skip
SMALL = ["train.steps=3", "train.seq_length=32", "train.micro_batch_size=2",
         "train.global_batch_size=4", "train.warmup_steps=1"]  # fmt: skip


@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory):
    metrics = tmp_path_factory.mktemp("router") / "m.jsonl"
    run = assert_ok(train([*DEEPSEEK, *SMALL], config="gpt_tiny_moe.yaml", metrics=metrics,
                          module="tests.training.router_train"))  # fmt: skip
    steps = [json.loads(line.split(": ", 1)[1]) for line in run.stdout.splitlines()
             if line.startswith("router step ")]  # fmt: skip
    return run, steps


def _mtp_inner_layer() -> str:
    """The attribute Megatron's ``MultiTokenPredictionLayer`` keeps its layer in, read from what
    its ``__init__`` assigns: ``transformer_layer`` (megatron-core <= 0.16) or
    ``mtp_model_layer`` (0.17+)."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

    names = MultiTokenPredictionLayer.__init__.__code__.co_names
    (inner,) = {"transformer_layer", "mtp_model_layer"} & set(names)
    return inner


def test_expert_bias_moves_as_megatrons_update_moves_it(deepseek_run):
    _, steps = deepseek_run
    assert len(steps) == 3
    routers = set(steps[0])
    mtp_router = f"mtp.layers.0.{_mtp_inner_layer()}.mlp.router"
    assert routers == {"decoder.layers.1.mlp.router", mtp_router}
    for step, seen in enumerate(steps, start=1):
        for name, record in seen.items():
            counts = torch.tensor(record["counts"])
            before = torch.tensor(record["before"])
            assert counts.sum() == 4 * 32 * 2, (step, name)  # every token, top-2
            want = before + RATE * torch.sign(counts.mean() - counts)
            torch.testing.assert_close(torch.tensor(record["after"]), want, rtol=0, atol=0)
            if step > 1:  # the bias a step routes with is the previous step's result
                assert record["before"] == steps[step - 2][name]["after"]
    assert any(v != 0 for v in steps[0]["decoder.layers.1.mlp.router"]["after"])


def test_multi_token_prediction_is_built_and_trains(deepseek_run):
    """One MTP layer is built, and its loss (predicting the token after next) is a language-model
    loss of the main one's size (both start near ln(vocab) = 5.6)."""
    run, _ = deepseek_run
    assert "mtp layers: 1" in run.stdout
    mtp = [json.loads(line.split(": ", 1)[1]) for line in run.stdout.splitlines()
           if line.startswith("mtp step ")]  # fmt: skip
    assert len(mtp) == len(run.losses) == 3
    for (mtp_loss,), loss in zip(mtp, run.losses):
        assert 0.5 * loss < mtp_loss < 2 * loss, (mtp_loss, loss)
