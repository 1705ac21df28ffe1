"""Megatron's hybrid model (configs/gpt_tiny_hybrid.yaml: pattern ``M-M*ME``, Mamba, MLP,
attention and MoE layers) under torchrun (gloo) against one process.

Each layout trains 5 steps from the same step-0 checkpoint, in sbhd and in packed thd
(``data.pack_sequences``), and must give the one-process losses and gradient norms within 1e-5:

=================  ================================================================
layout             what it splits
=================  ================================================================
``tp2_sp``         Mamba heads and groups, attention heads over 2 TP ranks, sequence
                   parallel (the experts whole on each: expert TP 1)
``cp2``            the sequence over 2 CP ranks: Mamba by all-to-all (sequence <->
                   heads), the attention layer by all-gather
``pp2``            2 pipeline stages across the pattern: ``M-M`` and ``*ME``
``recompute``      selective recompute of the mixers' core (one process)
=================  ================================================================

All 2-rank runs share one launch, and both one-process references (sbhd, thd) and the step-0
checkpoint another (``tests.launch.layout_runs``).
"""

from __future__ import annotations

import pytest

from mcore_npu.transformer.hybrid_pattern import symbols
from tests.launch import (
    assert_layout_matches,
    layout_runs,
    max_abs_diff,
    read_metrics,
    reported,
)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif("E" not in symbols(), reason="the MoE slot (E): megatron-core 0.16+"),
]

CONFIG = "gpt_tiny_hybrid.yaml"
STEPS = 5
BATCH = ["train.micro_batch_size=2", "train.global_batch_size=4", f"train.steps={STEPS}",
         "train.seq_length=64", "train.progress=false"]  # fmt: skip
FORMATS = {"sbhd": [], "thd": ["data.pack_sequences=true"]}
ONE = {"tp": 1, "cp": 1, "ep": 1, "dp": 1}
LAYOUTS = {  # name -> (processes, overrides, expected {tp, cp, ep, dp})
    "tp2_sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true",
                   "parallel.expert_tensor=1"], {**ONE, "tp": 2}),
    "cp2": (2, ["parallel.context=2", "parallel.cp_comm_type=all_gather"], {**ONE, "cp": 2}),
    "pp2": (2, ["parallel.pipeline=2"], ONE),
    "recompute": (1, ["model.recompute_granularity=selective",
                      "model.recompute_modules=[core_attn]"], ONE),
}  # fmt: skip
TOLERANCE = 1e-5


def _name(layout: str, fmt: str) -> str:
    return f"hybrid_{layout}_{fmt}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[list[dict], str]]:
    """``name -> (metrics of each step, stdout of its launch)`` for every run."""
    workdir = tmp_path_factory.mktemp("hybrid_parallel")

    def run(name, overrides):
        metrics = f"train.metrics_file={workdir / name}.jsonl"
        return [name, [*BATCH, *overrides, f"train.init_from={workdir / 'init'}", metrics]]

    init = ["init", ["train.steps=0", "train.progress=false",
                     f"train.checkpoint_dir={workdir / 'init'}"]]  # fmt: skip
    stdout = {}
    for nproc in (1, 2):
        planned = [run(_name(layout, fmt), [*overrides, *extra])
                   for layout, (size, overrides, _) in LAYOUTS.items() if size == nproc
                   for fmt, extra in FORMATS.items()]  # fmt: skip
        if nproc == 1:
            planned = [init, *(run(_name("single", f), e) for f, e in FORMATS.items()), *planned]
        out = layout_runs(CONFIG, planned, nproc=nproc)
        stdout.update(dict.fromkeys((name for name, _ in planned if name != "init"), out))
    return {name: (read_metrics(workdir / f"{name}.jsonl"), out) for name, out in stdout.items()}


def _losses(metrics) -> list[float]:
    return [m["loss"] for m in metrics]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hybrid_layout_matches_one_process(layout, fmt, runs):
    metrics, stdout = runs[_name(layout, fmt)]
    single, _ = runs[_name("single", fmt)]
    assert len(metrics) == STEPS
    expected, sp = LAYOUTS[layout][2], layout == "tp2_sp"
    assert_layout_matches(stdout, _name(layout, fmt), metrics, single, expected, sp, TOLERANCE)


def test_pp2_stages_split_the_hybrid_pattern(runs):
    """Stage 0 builds layers 1-3 (M - M), stage 1 layers 4-6 (* M E)."""
    _, stdout = runs[_name("pp2", "sbhd")]
    assert reported(stdout, _name("pp2", "sbhd"), "stage 0 layers") == "[1, 2, 3]"
    assert reported(stdout, _name("pp2", "sbhd"), "stage 1 layers") == "[4, 5, 6]"


def test_the_references_learn_and_packing_changes_nothing(runs):
    """The one-process runs: the loss falls over the 5 steps, and the packed run equals the
    unpacked one (every packed sequence is a whole row)."""
    sbhd, thd = (_losses(runs[_name("single", fmt)][0]) for fmt in FORMATS)
    assert sbhd[-1] < sbhd[0]
    assert max_abs_diff(sbhd, thd) <= TOLERANCE, (sbhd, thd)
