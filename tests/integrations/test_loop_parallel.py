"""verl's loop with the plugin's engine on more than one rank: torchrun, one ``TrainingWorker`` per
rank, no Ray; TP=2 with sequence parallelism, PP=2, DP=2 with the distributed optimizer, EP=2
(Qwen3-MoE), each 5 SFT steps, compared with one process.

One torchrun launch of 2 ranks runs the four layouts in turn (``verl_loop_ranks.py``); the
one-process runs are conftest's session runs (same settings, same seeded global batch; each rank
of a torchrun layout trains on its data-parallel share). The hang guard is
``tests.launch.run_command``'s (own session, whole group killed); nothing is timed.

Tolerances. verl's engine is bf16 (``McoreEngineConfig`` accepts only bf16 / fp16,
``verl/workers/config/engine.py:218``): every matmul's output, weight gradients included, rounds
to bf16, and the gradients then add up in fp32. PP=2 and DP=2 run exactly the one process's
micro-batches through the same bf16 operations and differ only in the order of the fp32 sums:
within 1e-5. TP=2 splits the matmuls themselves (two bf16 partial products summed), and under
EP=2 an expert's matmul takes the tokens of both ranks' micro-batches at once (the alltoall
dispatch), so its bf16 weight gradient sums other partial products than one process's: both
agree to bf16 precision, 2e-3 (EP=2's first loss, before any update, within 1e-5). In fp32 the
plugin's own trainer shows TP / EP equal to one process within 1e-5 (``tests/distributed``);
verl's engine cannot run fp32.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("verl")

from tests.integrations import verl_loop_ranks
from tests.launch import ROOT, TORCHRUN, run_command

pytestmark = pytest.mark.usefixtures("cpu_runtime")

SCRIPT = ROOT / "tests" / "integrations" / "verl_loop_ranks.py"
WORLD = 2
TOLERANCE = {"tp2_sp": 2e-3, "pp2": 1e-5, "dp2": 1e-5, "ep2": 2e-3}
EXPECTED = {  # the layout each run must have had (read back from Megatron's parallel state)
    "tp2_sp": {"tp": 2, "pp": 1, "dp": 1, "ep": 1, "sp": True},
    "pp2": {"tp": 1, "pp": 2, "dp": 1, "ep": 1, "sp": False},
    "dp2": {"tp": 1, "pp": 1, "dp": 2, "ep": 1, "sp": False},
    "ep2": {"tp": 1, "pp": 1, "dp": 2, "ep": 2, "sp": False},
}


@pytest.fixture(scope="module")
def launch(qwen3, qwen3_moe, tiny_deepseek_v3_model, tmp_path_factory):
    """The output folder of one torchrun launch: every layout of ``EXPECTED``, then the
    DeepSeek-V3 bridge check at TP=2 (``verl_loop_ranks.deepseek_tp2``)."""
    out = tmp_path_factory.mktemp("ranks")
    cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={WORLD}", str(SCRIPT), str(out),
           qwen3, qwen3_moe, tiny_deepseek_v3_model, *EXPECTED, "deepseek_tp2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    done = run_command(cmd, cwd=ROOT, env=env)
    assert done.returncode == 0, (
        f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return out


@pytest.fixture(scope="module")
def ranks(launch) -> dict[str, list[dict]]:
    """``{layout: [record of rank 0, record of rank 1]}``."""
    out = launch
    return {
        name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)]
        for name in EXPECTED
    }


def _reference(name: str, dense_sft_run, moe_sft_run) -> list[float]:
    family = verl_loop_ranks.LAYOUTS[name][0]
    _, metrics = dense_sft_run if family == "qwen3" else moe_sft_run
    return [m["loss"] for m in metrics[: verl_loop_ranks.STEPS]]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_layout_equals_one_process(name, ranks, dense_sft_run, moe_sft_run):
    records = ranks[name]
    for record in records:
        assert record["engine"] == "NPUMegatronEngineWithLMHead"
        assert {k: record["layout"][k] for k in EXPECTED[name]} == EXPECTED[name]
        assert record["layout"]["distributed_optimizer"] is True
    with_outputs = [r["losses"] for r in records if r["losses"] is not None]
    # verl returns outputs on tensor rank 0 of the last pipeline stage: one rank under TP / PP,
    # both under DP / EP (the same all-reduced loss)
    assert len(with_outputs) == (1 if name in ("tp2_sp", "pp2") else WORLD)
    assert all(losses == with_outputs[0] for losses in with_outputs)
    want = _reference(name, dense_sft_run, moe_sft_run)
    error = max(abs(a - b) for a, b in zip(with_outputs[0], want, strict=True))
    print(f"{name}: max |loss - one process| over {len(want)} steps = {error:.2e}", file=sys.stderr)
    assert error <= TOLERANCE[name], (name, with_outputs[0], want)
    if name == "ep2":  # the forward before any update: the dispatch itself is exact
        assert abs(with_outputs[0][0] - want[0]) <= 1e-5
    assert want[-1] < want[0]  # the compared runs train


def test_deepseek_v3_through_mbridge_at_tp2(launch, tiny_deepseek_v3_model):
    """mbridge's deepseek_v3 bridge at TP=2 (sequence parallel) with the NPU spec: the MLA down
    projections are Megatron's ColumnParallelLinear, TP-sharded along their output (dim 0);
    mbridge splits a checkpoint tensor by the shape difference to the parameter
    (``Bridge._weight_split_across_tp``: whole if equal, chunks along the differing dim, so a
    duplicated TELinear and this sharded layer both load) and gathers on export the parameters
    marked ``tensor_model_parallel`` (along ``partition_dim``). The logits equal transformers'
    within 1e-4 and every rank exports the checkpoint bit for bit."""
    import torch
    import transformers

    records = [json.loads((launch / f"deepseek_tp2.rank{r}.json").read_text())
               for r in range(WORLD)]  # fmt: skip
    for record in records:
        assert (record["tp"], record["sp"]) == (2, True)
        downs = record["down_projections"]
        assert downs["linear_q_down_proj"] == {  # q_lora_rank 32 over 2 ranks
            "shape": [16, 64],
            "tensor_model_parallel": True,
            "partition_dim": 0,
        }
        assert downs["linear_kv_down_proj"] == {  # kv_lora_rank + rope = 16 + 8 over 2 ranks
            "shape": [12, 64],
            "tensor_model_parallel": True,
            "partition_dim": 0,
        }
        assert record["exported_names_equal"] and record["exported_not_equal"] == []
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tiny_deepseek_v3_model).eval()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    got = torch.load(launch / "deepseek_tp2.logits.pt")  # [b, s, V], gathered over TP
    error = float((got - want).abs().max())
    print(f"DeepSeek-V3 at TP=2: max |logit - transformers| = {error:.1e}", file=sys.stderr)
    assert error <= 1e-4, error
