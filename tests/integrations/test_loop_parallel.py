"""verl's loop with the plugin's engine on more than one rank: torchrun, one ``TrainingWorker`` per
rank, no Ray; TP=2 with sequence parallelism, PP=2, DP=2 with the distributed optimizer, EP=2
(Qwen3-MoE), CP=2 in bshd (the engine's own forward: every row split zigzag, fp32 only), each 5
SFT steps, compared with one process (thd); DP=2 resuming exactly; and
the tiny DeepSeek-V3 through mbridge and a tiny Qwen3.5-MoE through the plugin's bridge at TP=2.

One torchrun launch of 2 ranks runs every layout in turn, in fp32 and in bf16
(``verl_loop_ranks.py``), and DP=2 in bf16 also saves after step 5, trains on, and resumes in
fresh workers. The one-process references run in this process with the same settings and the
same seeded global batch (each rank of a torchrun layout trains on its data-parallel share): in
bf16, conftest's session runs; in fp32, :func:`fp32_reference`. The hang guard is
``tests.launch.run_command``'s (own session, whole group killed); nothing is timed.

Precision. verl's config refuses float32 (``McoreEngineConfig.__post_init__``: ``assert
self.dtype in ["bfloat16", "float16"]``, ``verl/workers/config/engine.py:218``); the
parallel-equality check runs in fp32, set in the test only, after verl's validation
(``verl_loop.force_fp32``, like an oracle setting), so that TP's split matmuls can be compared at
1e-5. verl's engine then builds an fp32 model and Megatron's distributed optimizer over fp32
parameters; nothing else on verl's training path forces bf16. In fp32 every layout equals one process within
1e-5. The same layouts in bf16, as verl runs them: PP=2 and DP=2 run exactly the one process's
micro-batches through the same bf16 operations and differ only in the order of the fp32 sums:
within 1e-5. TP=2 splits the matmuls themselves (two bf16 partial products summed), and under
EP=2 an expert's matmul takes the tokens of both ranks' micro-batches at once (the alltoall
dispatch), so its bf16 weight gradient sums other partial products than one process's: both
agree to bf16 precision, 2e-3 (EP=2's first loss, before any update, within 1e-5).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("verl")

from tests.integrations import verl_loop as loop
from tests.integrations import verl_loop_ranks
from tests.launch import ROOT, TORCHRUN, run_command

pytestmark = [pytest.mark.usefixtures("cpu_runtime"), pytest.mark.distributed, pytest.mark.slow]

SCRIPT = ROOT / "tests" / "integrations" / "verl_loop_ranks.py"
WORLD = 2
STEPS = verl_loop_ranks.STEPS
EXPECTED = {  # the layout each run must have had (read back from Megatron's parallel state)
    "tp2_sp": {"tp": 2, "pp": 1, "dp": 1, "ep": 1, "sp": True},
    "pp2": {"tp": 1, "pp": 2, "dp": 1, "ep": 1, "sp": False},
    "dp2": {"tp": 1, "pp": 1, "dp": 2, "ep": 1, "sp": False},
    "ep2": {"tp": 1, "pp": 1, "dp": 2, "ep": 2, "sp": False},
    "cp2_bshd": {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "cp": 2, "sp": False},
}
RUNS = [*EXPECTED, *(f"{name}@bf16" for name in EXPECTED if name != "cp2_bshd")]
TOLERANCE = {  # fp32: the 1e-5 for every layout; bf16: see the module docstring
    **dict.fromkeys(EXPECTED, 1e-5),
    "tp2_sp@bf16": 2e-3, "pp2@bf16": 1e-5, "dp2@bf16": 1e-5, "ep2@bf16": 2e-3,
}  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    """``(path, transformers model)``: the tiny Qwen3.5-MoE (tests/integrations/qwen3_5_models.py)."""
    from tests.integrations.qwen3_5_models import save_tiny

    path = tmp_path_factory.mktemp("tiny_qwen3_5_moe_tp2")
    return str(path), save_tiny(path, "moe")


@pytest.fixture(scope="module")
def launch(qwen3, qwen3_moe, tiny_deepseek_v3_model, qwen3_5_moe, qwen3_5_hub, qwen3_vl,
           qwen3_vl_moe, tmp_path_factory):  # fmt: skip
    """The output folder of one torchrun launch: every run of ``RUNS``, then the DeepSeek-V3
    and Qwen3.5 bridge checks at TP=2 (``verl_loop_ranks.deepseek_tp2`` / ``qwen3_5_tp2``),
    verl's R2 router replay at PP=2 and EP=2 (``replay_layouts``), the Qwen3.5 hub checkpoint
    through verl at CP=2 (``qwen3_5_hub_cp2``) and Qwen3-VL (and the Qwen3.5 hub checkpoint at
    PP=2) with images (``qwen3_vl_layouts``)."""
    out = tmp_path_factory.mktemp("ranks")
    cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={WORLD}", str(SCRIPT), str(out),
           qwen3, qwen3_moe, tiny_deepseek_v3_model, *RUNS, "deepseek_tp2",
           verl_loop_ranks.REPLAY,
           f"{verl_loop_ranks.QWEN3_5_TP2}{qwen3_5_moe[0]}",
           f"{verl_loop_ranks.QWEN3_5_HUB_CP2}{qwen3_5_hub}",
           f"{verl_loop_ranks.QWEN3_VL}{qwen3_vl},{qwen3_vl_moe},{qwen3_5_hub}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    done = run_command(cmd, cwd=ROOT, env=env)
    assert done.returncode == 0, (
        f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return out


@pytest.fixture(scope="module")
def ranks(launch) -> dict[str, list[dict]]:
    """``{run: [record of rank 0, record of rank 1]}``."""
    return {
        run: [json.loads((launch / f"{run}.rank{r}.json").read_text()) for r in range(WORLD)]
        for run in RUNS
    }


@pytest.fixture(scope="module")
def fp32_reference(qwen3, qwen3_moe) -> dict[str, list[float]]:
    """``{family: losses}``: 5 SFT steps in one process with the fp32 oracle
    (``verl_loop.force_fp32``), the settings of the torchrun runs."""
    losses = {}
    for family, path in (("qwen3", qwen3), ("qwen3_moe", qwen3_moe)):
        config = loop.worker_config(path, **loop.FAMILY_SETTINGS[family], dtype="float32")
        worker = loop.new_worker(config, loop.sft_loss_fn())
        assert {p.dtype for p in worker.engine.module[0].parameters()} == {torch.float32}
        assert config.engine_config.dtype == worker.engine.engine_config.dtype == "float32"
        losses[family] = [m["loss"] for m in loop.train_sft(worker, STEPS)]
        del worker
    return losses


def _reference(run: str, fp32_reference, dense_sft_run, moe_sft_run) -> list[float]:
    name, dtype = verl_loop_ranks.parse_run(run)
    family = verl_loop_ranks.LAYOUTS[name][0]
    if dtype == "float32":
        return fp32_reference[family]
    _, metrics = dense_sft_run if family == "qwen3" else moe_sft_run
    return [m["loss"] for m in metrics[:STEPS]]


@pytest.mark.parametrize("run", RUNS)
def test_layout_equals_one_process(run, ranks, fp32_reference, dense_sft_run, moe_sft_run):
    name, dtype = verl_loop_ranks.parse_run(run)
    records = ranks[run]
    for record in records:
        assert record["engine"] == "NPUMegatronEngineWithLMHead"
        assert {k: record["layout"][k] for k in EXPECTED[name]} == EXPECTED[name]
        assert record["layout"]["distributed_optimizer"] is True
        want_dtype = "torch.float32" if dtype == "float32" else "torch.bfloat16"
        assert record["layout"]["params_dtype"] == record["layout"]["model_dtype"] == want_dtype
    own_forward = [record["own_forward_steps"] > 0 for record in records]
    assert own_forward == [name == "cp2_bshd"] * WORLD  # bshd: the engine's own forward
    with_outputs = [r["losses"] for r in records if r["losses"] is not None]
    # verl returns outputs on tensor and context rank 0 of the last pipeline stage: one rank
    # under TP / PP / CP, both under DP / EP (the same all-reduced loss)
    assert len(with_outputs) == (1 if name in ("tp2_sp", "pp2", "cp2_bshd") else WORLD)
    assert all(losses == with_outputs[0] for losses in with_outputs)
    want = _reference(run, fp32_reference, dense_sft_run, moe_sft_run)
    error = max(abs(a - b) for a, b in zip(with_outputs[0], want, strict=True))
    print(f"{run}: max |loss - one process| over {len(want)} steps = {error:.2e}", file=sys.stderr)
    assert error <= TOLERANCE[run], (run, with_outputs[0], want)
    if run == "ep2@bf16":  # the forward before any update: the dispatch itself is exact
        assert abs(with_outputs[0][0] - want[0]) <= 1e-5
    assert want[-1] < want[0]  # the compared runs train


def test_fp32_oracle_is_not_the_bf16_run(fp32_reference, dense_sft_run, moe_sft_run):
    """The fp32 references really are other numbers than verl's bf16 runs (the oracle took)."""
    for family, (_, metrics) in (("qwen3", dense_sft_run), ("qwen3_moe", moe_sft_run)):
        bf16 = [m["loss"] for m in metrics[:STEPS]]
        assert fp32_reference[family] != bf16, family


def test_dp2_distributed_optimizer_resumes_exactly(ranks):
    """DP=2, bf16, the distributed optimizer's state sharded over both ranks: ``save_checkpoint``
    after step 5, fresh workers on both ranks ``load_checkpoint`` it (through the engine's exact
    Adam resume), steps 6-10 equal the uninterrupted run within 1e-6. (The control, verl's own
    Megatron load drifting or asserting, is ``test_loop.py``'s.)"""
    records = ranks[verl_loop_ranks.RESUME]
    for rank, record in enumerate(records):
        resume = record["resume"]
        assert resume["steps"] == [float(STEPS)], (rank, resume["steps"])
        count, distinct = resume["step_tensors"]
        assert count > 0 and distinct == count  # one counter per parameter (this rank's shard)
        error = max(abs(a - b) for a, b in zip(resume["resumed"], resume["uninterrupted"],
                                                strict=True))  # fmt: skip
        print(f"DP=2 resume, rank {rank}: max |loss - uninterrupted| over steps 6-10 = "
              f"{error:.2e}", file=sys.stderr)  # fmt: skip
        assert error <= 1e-6, (rank, resume)
        assert resume["uninterrupted"][0] < record["losses"][-1]  # it continued training
    assert records[0]["resume"]["resumed"] == records[1]["resume"]["resumed"]


def test_deepseek_v3_through_mbridge_at_tp2(launch, tiny_deepseek_v3_model):
    """mbridge's deepseek_v3 bridge at TP=2 (sequence parallel) with the NPU spec: the MLA down
    projections are Megatron's ColumnParallelLinear, TP-sharded along their output (dim 0);
    mbridge splits a checkpoint tensor by the shape difference to the parameter
    (``Bridge._weight_split_across_tp``: whole if equal, chunks along the differing dim, so a
    duplicated TELinear and this sharded layer both load) and gathers on export the parameters
    marked ``tensor_model_parallel`` (along ``partition_dim``). The logits equal transformers'
    within 1e-4 and every rank exports the checkpoint bit for bit."""
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


def test_qwen3_5_through_the_plugins_bridge_at_tp2(launch, qwen3_5_moe):
    """The plugin's Qwen3.5 bridge at TP=2 (sequence parallel): GDN's ``in_proj`` holds this
    rank's heads of every section (half of ``[q | k | v | z | beta | alpha]``), the logits equal
    transformers' within 1e-4, and every rank exports the checkpoint bit for bit (the split and
    the merge are exact inverses)."""
    _, hf_model = qwen3_5_moe
    for rank in range(WORLD):
        record = json.loads((launch / f"qwen3_5_tp2.rank{rank}.json").read_text())
        assert (record["tp"], record["sp"]) == (2, True)
        assert record["in_proj_rows"] == (2 * 32 + 2 * 32 + 2 * 4) // 2
        assert record["exported_names_equal"] and record["exported_not_equal"] == []
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf_model(input_ids=ids).logits
    got = torch.load(launch / "qwen3_5_tp2.logits.pt")  # [b, s, V], gathered over TP
    error = float((got - want).abs().max())
    print(f"Qwen3.5-MoE at TP=2: max |logit - transformers| = {error:.1e}", file=sys.stderr)
    assert error <= 1e-4, error


def test_the_qwen3_5_hub_checkpoint_through_verl_at_cp2_in_bshd(launch, qwen3_5_hub):
    """Rows 10 and 26 of the census at CP > 1: the hub form (``vision_config``) in bshd with the
    32k recipe's keys (``kvallgather_cp_algo``) at CP=2, fp32: the engine's own forward splits
    every row zigzag over the two ranks (the GDN layers run CP by all-to-all, the attention
    layer all-gathers K/V), and verl's log-prob pass equals transformers' within 1e-4."""
    import transformers

    from tests.integrations.log_probs import hf_log_probs

    for rank in range(WORLD):
        record = json.loads((launch / f"qwen3_5_hub_cp2.rank{rank}.json").read_text())
        assert record["cp"] == 2 and record["cp_comm_type"] == "all_gather"
        assert record["own_forward_steps"] > 0
    lengths = verl_loop_ranks.HUB_CP2_LENGTHS
    got = torch.load(launch / "qwen3_5_hub_cp2.log_probs.pt")
    want = hf_log_probs(qwen3_5_hub, lengths, transformers.Qwen3_5MoeForConditionalGeneration)
    error = max(float((g[: n - 1] - w).abs().max())
                for g, w, n in zip(got, want, lengths, strict=True))  # fmt: skip
    print(f"Qwen3.5 hub at CP=2, bshd: max |log p - transformers| = {error:.1e}", file=sys.stderr)
    assert error <= 1e-4, error


# per rank: (tp, pp, pp rank, cp, ep, dp, sp, holds the vision tower)
EXPECTED_VL = {
    "tp2_sp": [(2, 1, 0, 1, 1, 1, True, True)] * 2,
    "pp2": [(1, 2, 0, 1, 1, 1, False, True), (1, 2, 1, 1, 1, 1, False, False)],
    "ep2": [(1, 1, 0, 1, 2, 2, False, True)] * 2,
    "cp2": [(1, 1, 0, 2, 1, 1, False, True)] * 2,
    "hub_pp2": [(1, 2, 0, 1, 1, 1, False, True), (1, 2, 1, 1, 1, 1, False, False)],
}


@pytest.mark.parametrize("layout", list(verl_loop_ranks.QWEN3_VL_LAYOUTS))
def test_qwen3_vl_layout_equals_one_process(layout, launch, qwen3_vl, qwen3_vl_moe, qwen3_5_hub):
    """Qwen3-VL with images (two of different grids in one row) through verl's worker, fp32,
    thd: TP=2 (sequence parallel), PP=2 (the vision tower on stage 0 only), CP=2 (each rank its
    chunks of every packed row, split after the vision embedding) and, for the MoE form, EP=2
    (with DP=2: each rank trains on its half of the rows) train 5 steps with the losses of one
    process within 1e-5; so does the Qwen3.5 hub checkpoint (GDN hybrid, no deepstack) at PP=2."""
    from tests.integrations import qwen3_vl_data

    records = [json.loads((launch / f"qwen3_vl_{layout}.rank{r}.json").read_text())
               for r in range(WORLD)]  # fmt: skip
    layouts = [(r["tp"], r["pp"], r["pp_rank"], r["cp"], r["ep"], r["dp"], r["sp"], r["vision"])
               for r in records]  # fmt: skip
    assert layouts == EXPECTED_VL[layout], layouts
    family = verl_loop_ranks.QWEN3_VL_LAYOUTS[layout][0]
    path = {"dense": qwen3_vl, "moe": qwen3_vl_moe, "qwen3_5_hub": qwen3_5_hub}[family]
    rows = qwen3_vl_data.family_rows(family)
    config = loop.worker_config(path, micro_batch=len(rows), dtype="float32")
    worker = loop.new_worker(config, loop.sft_loss_fn())
    want = [m["loss"] for m in qwen3_vl_data.train(worker, STEPS, rows)]
    del worker
    got = next(r["losses"] for r in records if r["losses"] is not None)
    error = max(abs(a - b) for a, b in zip(got, want, strict=True))
    print(f"qwen3_vl {layout}: max |loss - one process| over {STEPS} steps = {error:.2e}",
          file=sys.stderr)  # fmt: skip
    assert error <= 1e-5, (got, want)
    assert want[-1] < want[0]


# per rank: (pp, ep, tp, cp, dp, the global layers of its routers)
EXPECTED_REPLAY = {
    "pp2": [(2, 1, 1, 1, 1, [0]), (2, 1, 1, 1, 1, [1])],
    "ep2": [(1, 2, 1, 1, 2, [0, 1])] * 2,
    "tp2_sp_bshd": [(1, 1, 2, 1, 1, [0, 1])] * 2,
    "cp2_bshd": [(1, 1, 1, 2, 1, [0, 1])] * 2,
}


@pytest.mark.parametrize("layout", list(verl_loop_ranks.REPLAY_LAYOUTS))
def test_router_replay_layout(layout, launch):
    """verl's R2 on the tiny Qwen3-MoE at PP=2 (each stage its layer's router) and EP=2 (DP=2) in
    thd, at TP=2 with SP and CP=2 in bshd (the engine's own forward): after the routers are
    perturbed, the update routes every token of every MoE layer to the experts recorded in
    ``compute_log_prob``, and (thd) those are the routes verl returns (the
    one-process test, tests/integrations/test_router_replay.py, has the control showing the
    perturbation moves the routes without replay)."""
    records = [json.loads((launch / f"replay_{layout}.rank{r}.json").read_text())
               for r in range(WORLD)]  # fmt: skip
    layouts = [(r["pp"], r["ep"], r["tp"], r["cp"], r["dp"], r["layers"]) for r in records]
    assert layouts == EXPECTED_REPLAY[layout], layouts
    for record in records:
        assert all(record["replayed"]), record
        assert (record["returned"] is None) == layout.endswith("bshd"), record
        assert record["returned"] is None or all(record["returned"]), record
    if layout.endswith("bshd"):  # each real token replayed on exactly one rank, in every layer
        per_layer = [sum(counts) for counts in zip(*(r["tokens"] for r in records))]
        assert per_layer == [records[0]["real"]] * len(per_layer), per_layer
