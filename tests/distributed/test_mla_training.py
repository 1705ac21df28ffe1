"""``mcore-npu train`` with the tiny DeepSeek-V3-shaped model (configs/gpt_tiny_mla.yaml: MLA with
q_lora_rank and yarn, a dense first layer, then the DeepSeek-V3 router with expert bias,
group-limited top-2 and a shared expert, grouped experts): parallel layouts against one process,
cross-layout resume, and the TE names of its checkpoint.

Two launches of ``tests/distributed/layout_runs.py`` (several runs of the real ``Trainer`` one
after another, one import of Megatron per launch); each step is 2 sequences of 64 tokens in
micro-batches of 1:

- one process: the 5-step reference run (te layout, checkpoint at the end), then the same 5 steps
  split over three runs that resume each other with model, optimizer, scheduler and step:
  steps 1-2 in the te layout, 3-4 in the local layout (``moe_grouped_gemm=false``: the local
  layout's experts are SequentialMLP's names), 5 in the te layout again;
- torchrun, 2 ranks: CP=2 with p2p and with all_gather, TP=2 with sequence parallelism, EP=2
  (expert data parallel 1, data parallel 2), and CP=2 x EP=2 (the experts split over the two
  context-parallel ranks, as the Moonlight recipe runs them: configs/ascend_moonlight_16b.yaml).

The same model with DeepSeek Sparse Attention (configs/gpt_tiny_dsa.yaml's keys, the indexer
trained with loss coefficient 10) runs once in each launch: one process, then TP=2 with SP and
all-gather CP=2.

Every run starts from the seed (no checkpoint): with ``use_cpu_initialization`` Megatron draws
every weight whole and each rank keeps its shard, and the grouped experts draw all experts on
every rank, so all layouts start from the one process's weights.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.launch import CONFIGS, layout_runs, max_abs_diff, read_metrics, reported
from tests.megatron_features import DSA_CONFIG_FIELDS, missing_fields, needs_fields

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CONFIG = CONFIGS / "gpt_tiny_mla.yaml"
STEPS = 5
BATCH = [f"train.steps={STEPS}", "train.micro_batch_size=1", "train.global_batch_size=2",
         "train.seq_length=64", "train.progress=false"]  # fmt: skip
LAYOUTS = {  # name: (overrides, the layout Megatron's parallel state must have had)
    "cp2_p2p": (["parallel.context=2", "parallel.cp_comm_type=p2p"],
                {"tp": 1, "cp": 2, "ep": 1, "dp": 1, "sp": False}),
    "cp2_all_gather": (["parallel.context=2", "parallel.cp_comm_type=all_gather"],
                       {"tp": 1, "cp": 2, "ep": 1, "dp": 1, "sp": False}),
    "tp2": (["parallel.tensor=2", "parallel.sequence_parallel=true"],
            {"tp": 2, "cp": 1, "ep": 1, "dp": 1, "sp": True}),
    "ep2": (["parallel.expert=2"], {"tp": 1, "cp": 1, "ep": 2, "dp": 2, "sp": False}),
    "cp2_ep2": (["parallel.context=2", "parallel.expert=2"],
                {"tp": 1, "cp": 2, "ep": 2, "dp": 1, "sp": False}),
}  # fmt: skip
MODULES = "attention=NPUMLASelfAttention, router=NPUTopKRouter, experts=NPUGroupedMLP"
# the same model with DeepSeek Sparse Attention (configs/gpt_tiny_dsa.yaml's keys): 16 of up to 64
# keys per query, the indexer trained (its KL loss at 10); its runs share the two launches
DSA = ["model.experimental_attention_variant=dsa", "model.dsa_indexer_n_heads=4",
       "model.dsa_indexer_head_dim=32", "model.dsa_indexer_topk=16",
       "model.dsa_indexer_loss_coeff=10.0"]  # fmt: skip
DSA_LAYOUTS = {name: LAYOUTS[name] for name in ("tp2", "cp2_all_gather")}
HAS_DSA = not missing_fields(*DSA_CONFIG_FIELDS)  # megatron-core 0.16+
DSA_MODULES = MODULES.replace("NPUMLASelfAttention", "NPUDSASelfAttention")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """``(workdir, stdout)``: the reference run and the te -> local -> te resume chain."""
    work = tmp_path_factory.mktemp("mla_one")
    chain = [f"train.checkpoint_dir={work / 'chain'}", f"train.metrics_file={work / 'chain.jsonl'}"]
    runs = [
        ["single", [*BATCH, f"train.checkpoint_dir={work / 'single'}",
                    f"train.metrics_file={work / 'single.jsonl'}"]],
        ["chain_te", [*BATCH, *chain, "train.exit_interval=2"]],
        ["chain_local", [*BATCH, *chain, "train.resume=true", "train.exit_interval=4",
                         "model.param_layout=local", "model.moe_grouped_gemm=false"]],
        ["chain_te_again", [*BATCH, *chain, "train.resume=true"]],
    ]  # fmt: skip
    if HAS_DSA:
        runs.append(["dsa_single", [*BATCH, *DSA, f"train.metrics_file={work}/dsa_single.jsonl"]])
    return work, layout_runs(CONFIG, runs)


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    """``(workdir, stdout)`` of one 2-rank launch running every layout of ``LAYOUTS`` (and of
    ``DSA_LAYOUTS`` with the DSA keys)."""
    work = tmp_path_factory.mktemp("mla_parallel")
    runs = [[name, [*BATCH, *overrides, f"train.metrics_file={work / name}.jsonl"]]
            for name, (overrides, _) in LAYOUTS.items()]  # fmt: skip
    for name, (overrides, _) in DSA_LAYOUTS.items() if HAS_DSA else ():
        metrics = f"train.metrics_file={work}/dsa_{name}.jsonl"
        runs.append([f"dsa_{name}", [*BATCH, *DSA, *overrides, metrics]])
    return work, layout_runs(CONFIG, runs, nproc=2)


def _losses(path, key: str = "loss") -> list[float]:
    return [m[key] for m in read_metrics(path)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layout_matches_one_process(layout, one_process, parallel):
    work, stdout = parallel
    single = _losses(one_process[0] / "single.jsonl")
    assert json.loads(reported(stdout, layout, "layout")) == LAYOUTS[layout][1]
    assert reported(stdout, layout, "modules") == MODULES
    losses = _losses(work / f"{layout}.jsonl")
    assert len(losses) == STEPS == len(single)
    error = max_abs_diff(losses, single)
    print(f"{layout}: max |loss - one process| over {STEPS} steps = {error:.1e}", file=sys.stderr)
    assert error <= 1e-5, (losses, single)
    assert single[-1] < single[0] - 0.5  # the model learns, so the steps differ


@needs_fields(*DSA_CONFIG_FIELDS, feature="DeepSeek Sparse Attention")
@pytest.mark.parametrize("layout", list(DSA_LAYOUTS))
def test_dsa_layout_matches_one_process(layout, one_process, parallel):
    """DeepSeek Sparse Attention (top-k 16 of 64, the indexer trained at loss coefficient 10)
    at TP=2 with SP and at all-gather CP=2 through Megatron's schedule: 5 losses within 1e-5 of
    one process's, and different from the dense MLA run's (the selection acts); the grad norms,
    which hold the indexer's gradients as the schedule scales its loss, within 1e-5 relative (a
    CP weighting off by 2 measured 6.4e-4). The top-k is discrete: at coefficient 0.1 a choice
    near a tie flipped at CP=2's fifth step (2.4e-5); at 10 none does (TP=2 9.5e-7, CP=2 4.8e-7,
    on megatron-core 0.16.1 and on 0.19.2). The layer's own gradients against one process:
    tests/distributed/mla_parallel.py."""
    work, stdout = parallel
    single = _losses(one_process[0] / "dsa_single.jsonl")
    assert reported(one_process[1], "dsa_single", "modules") == DSA_MODULES
    assert reported(stdout, f"dsa_{layout}", "modules") == DSA_MODULES
    assert json.loads(reported(stdout, f"dsa_{layout}", "layout")) == DSA_LAYOUTS[layout][1]
    losses = _losses(work / f"dsa_{layout}.jsonl")
    assert len(losses) == STEPS == len(single)
    error = max_abs_diff(losses, single)
    norms = _losses(work / f"dsa_{layout}.jsonl", "grad_norm")
    single_norms = _losses(one_process[0] / "dsa_single.jsonl", "grad_norm")
    norm_error = max_abs_diff(norms, single_norms) / max(single_norms)
    print(f"dsa {layout}: max |loss - one process| = {error:.1e}, grad norm (relative) "
          f"{norm_error:.1e}", file=sys.stderr)  # fmt: skip
    assert error <= 1e-5, (losses, single)
    assert norm_error <= 1e-5, (norms, single_norms)
    assert max_abs_diff(single, _losses(one_process[0] / "single.jsonl")) > 1e-4


def test_resume_across_layouts_equals_the_uninterrupted_run(one_process):
    """Steps 1-2 te, 3-4 local, 5 te, each resuming the previous run's checkpoint with its
    optimizer state: the 5 losses equal the uninterrupted te run's exactly."""
    work, stdout = one_process
    chain = read_metrics(work / "chain.jsonl")  # one file: each run continues it
    assert [m["step"] for m in chain] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in chain] == _losses(work / "single.jsonl")
    assert sorted(p.name for p in (work / "chain").glob("step_*")) == [
        "step_0000002", "step_0000004", "step_0000005"]  # fmt: skip
    for name in ("single", "chain_te", "chain_local", "chain_te_again"):
        assert reported(stdout, name, "modules") == MODULES, name


def test_the_te_checkpoint_has_exactly_the_te_spec_names(one_process):
    """The trained MLA + DeepSeek-V3 MoE model's checkpoint (te layout) holds exactly the names
    of specs/param_names_te.yaml; the local run's checkpoint holds others."""
    from torch.distributed.checkpoint import FileSystemReader

    from mcore_npu.training.config import load_config
    from mcore_npu.training.model import transformer_config
    from tests.transformer.te_names import disk_key, expected_names

    work, _ = one_process
    config = transformer_config(load_config(CONFIG))
    want = {disk_key(name, config) for name in expected_names(config, "sharded")}
    assert "decoder.layers.1.mlp.router.expert_bias" in want

    def saved(step_dir):
        metadata = FileSystemReader(str(step_dir)).read_metadata()
        keys = {key.split("/")[0] for key in metadata.state_dict_metadata}  # objects: key/shard
        return {key for key in keys if "optimizer." not in key}

    assert saved(work / "single" / "step_0000005") == want
    assert saved(work / "chain" / "step_0000004") != want  # the local layout's names
