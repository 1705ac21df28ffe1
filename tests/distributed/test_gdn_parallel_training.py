"""The Gated DeltaNet hybrid (configs/gpt_tiny_gdn.yaml: layers [GDN, GDN, GDN, attention], a
4-expert MoE with a shared expert in each) under torchrun (gloo) against one process.

Each layout trains 5 steps from the same step-0 checkpoint, in sbhd and in packed thd
(``data.pack_sequences``: 2 sequences of 64 tokens per micro-batch), and must give the
one-process losses and gradient norms within 1e-5:

=================  ================================================================
layout             what it splits
=================  ================================================================
``tp2_sp``         GDN heads and attention heads over 2 TP ranks, sequence parallel
                   (the experts whole on each: expert TP 1)
``cp2_all_gather`` the sequence over 2 CP ranks: GDN by all-to-all (sequence <->
                   heads), the attention layer by all-gather
``cp2_p2p``        the same, the attention layer by the p2p ring
``pp2``            2 pipeline stages across the hybrid pattern: [GDN, GDN] and
                   [GDN, attention]
``ep2``            the experts over 2 data-parallel ranks (alltoall dispatcher)
``recompute``      full recompute, uniform, 1 layer per block (one process)
=================  ================================================================

All 2-rank runs share one launch, and both one-process references (sbhd, thd) and the step-0
checkpoint another (``tests.launch.layout_runs``).
"""

from __future__ import annotations

import pytest

from tests.launch import (
    assert_layout_matches,
    layout_runs,
    max_abs_diff,
    read_metrics,
    reported,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

CONFIG = "gpt_tiny_gdn.yaml"
STEPS = 5
BATCH = ["train.micro_batch_size=2", "train.global_batch_size=4", f"train.steps={STEPS}",
         "train.seq_length=64", "train.progress=false"]  # fmt: skip
FORMATS = {"sbhd": [], "thd": ["data.pack_sequences=true"]}
LAYOUTS = {  # name -> (processes, overrides, expected {tp, cp, ep, dp})
    # expert TP 1: NPUGroupedMLP has no checkpoint for GLU experts split over TP
    "tp2_sp": (2, ["parallel.tensor=2", "parallel.sequence_parallel=true",
                   "parallel.expert_tensor=1"], {"tp": 2, "cp": 1, "ep": 1, "dp": 1}),
    "cp2_all_gather": (2, ["parallel.context=2", "parallel.cp_comm_type=all_gather"],
                       {"tp": 1, "cp": 2, "ep": 1, "dp": 1}),
    "cp2_p2p": (2, ["parallel.context=2", "parallel.cp_comm_type=p2p"],
                {"tp": 1, "cp": 2, "ep": 1, "dp": 1}),
    "pp2": (2, ["parallel.pipeline=2"], {"tp": 1, "cp": 1, "ep": 1, "dp": 1}),
    "ep2": (2, ["parallel.expert=2"], {"tp": 1, "cp": 1, "ep": 2, "dp": 2}),
    "recompute": (1, ["model.recompute_granularity=full", "model.recompute_method=uniform",
                      "model.recompute_num_layers=1"], {"tp": 1, "cp": 1, "ep": 1, "dp": 1}),
}  # fmt: skip
TOLERANCE = 1e-5


def _name(layout: str, fmt: str) -> str:
    return f"{layout}_{fmt}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gdn_parallel")


def _planned(workdir, nproc: int) -> list:
    runs = [[_name(layout, fmt), [*BATCH, *overrides, *extra,
                                  f"train.init_from={workdir / 'init'}",
                                  f"train.metrics_file={workdir / _name(layout, fmt)}.jsonl"]]
            for layout, (size, overrides, _) in LAYOUTS.items() if size == nproc
            for fmt, extra in FORMATS.items()]  # fmt: skip
    if nproc == 1:  # first the step-0 checkpoint, then the one-process references
        refs = [[_name("single", fmt), [*BATCH, *extra, f"train.init_from={workdir / 'init'}",
                                        f"train.metrics_file={workdir / _name('single', fmt)}.jsonl"]]
                for fmt, extra in FORMATS.items()]  # fmt: skip
        init = ["init", ["train.steps=0", "train.progress=false",
                         f"train.checkpoint_dir={workdir / 'init'}"]]  # fmt: skip
        runs = [init, *refs, *runs]
    return runs


@pytest.fixture(scope="module")
def runs(workdir) -> dict[str, tuple[list[dict], str]]:
    """``name -> (metrics of each step, stdout of its launch)`` for every run."""
    stdout = {}
    for nproc in (1, 2):
        planned = _planned(workdir, nproc)
        out = layout_runs(CONFIG, planned, nproc=nproc)
        stdout.update(dict.fromkeys((name for name, _ in planned), out))
    return {name: (read_metrics(workdir / f"{name}.jsonl"), out)
            for name, out in stdout.items() if name != "init"}  # fmt: skip


def _losses(metrics) -> list[float]:
    return [m["loss"] for m in metrics]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gdn_hybrid_layout_matches_one_process(layout, fmt, runs):
    metrics, stdout = runs[_name(layout, fmt)]
    single, _ = runs[_name("single", fmt)]
    assert len(metrics) == STEPS
    expected, sp = LAYOUTS[layout][2], layout == "tp2_sp"
    assert_layout_matches(stdout, _name(layout, fmt), metrics, single, expected, sp, TOLERANCE)


def test_pp2_stages_split_the_hybrid_pattern(runs):
    """Stage 0 builds layers 1-2 (GDN, GDN), stage 1 layers 3-4 (GDN, attention)."""
    _, stdout = runs[_name("pp2", "sbhd")]
    assert reported(stdout, _name("pp2", "sbhd"), "stage 0 layers") == "[1, 2]"
    assert reported(stdout, _name("pp2", "sbhd"), "stage 1 layers") == "[3, 4]"


def test_the_references_learn_and_packing_changes_nothing(runs):
    """The one-process runs: the loss falls over the 5 steps (so the steps differ), and the
    packed run equals the unpacked one (every packed sequence is a whole row)."""
    sbhd, thd = (_losses(runs[_name("single", fmt)][0]) for fmt in FORMATS)
    assert sbhd[-1] < sbhd[0]
    assert max_abs_diff(sbhd, thd) <= TOLERANCE, (sbhd, thd)
