"""``mcore-npu bench attention``: the reference kernel against Megatron's local attention and SDPA.

CPU, float32, forward only, b = 1, 16 heads of 64, causal self-attention, S in
{512, 1024, 2048, 4096} (quick: {512, 1024}); the methods are :data:`METHODS` (docs/bench.md
says what each runs). Memory is the peak of ``track_allocations`` over one call (outputs
included; the plugin's compressed mask is built before, once per process); time is the median
of interleaved calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_npu.masks import compressed_causal_mask
from mcore_npu.ops import fusion_attention, fusion_attention_with_stats
from mcore_npu.tools.bench import goal, markdown_table
from mcore_npu.tools.bench.mask import format_seconds
from mcore_npu.tools.bench.memory import track_allocations
from mcore_npu.tools.bench.timing import interleaved_medians

SEQ_LENS = (512, 1024, 2048, 4096)
# Not smaller: the quick goals are measured at its largest S, and below S = 1024 DPA's [16, S, S]
# scores still fit in cache, which puts "reference <= 0.5x DPA" within timing noise.
QUICK_SEQ_LENS = (512, 1024)
GOAL_SEQ = 2048  # S of the goals; quick runs use their largest S
HEADS = 16
HEAD_DIM = 64
SCALE = HEAD_DIM**-0.5
MIB = 2**20
SEED = 0

REFERENCE = "reference (SBH)"
DPA = "Megatron DPA"
SDPA = "SDPA (BNSD)"
REFERENCE_BNSD = "reference (BNSD input)"
SDPA_SBH_VIEWS = "SDPA (SBH views)"
STATS = "reference + stats (SBH)"
METHODS = (REFERENCE, DPA, SDPA, REFERENCE_BNSD, SDPA_SBH_VIEWS, STATS)
GOALS = (  # (what, the ratio measured, limit, kind)
    ("reference time / SDPA time", "reference_time_over_sdpa", 1.1, "time"),
    ("reference time / Megatron DPA time", "reference_time_over_dpa", 0.5, "time"),
    ("reference peak / Megatron DPA peak", "reference_peak_over_dpa", 0.25, "memory"),
    ("reference + stats time / SDPA time", "stats_time_over_sdpa", 1.5, "time"),
    ("reference + stats peak / SDPA peak", "stats_peak_over_sdpa", 2.0, "memory"),
)


def megatron_dot_product_attention():
    """Megatron-Core's own ``DotProductAttention``, the local spec's core attention, on the CPU
    (needs the parallel state ``measure`` sets up)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    hidden, cpu = HEADS * HEAD_DIM, {"use_cpu_initialization": True, "masked_softmax_fusion": False}
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=HEADS, attention_dropout=0.0, **cpu
    )
    return DotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=SCALE)


def _inputs(seq: int):
    """q, k, v in SBH ``[S, 1, N*D]`` and as contiguous BNSD ``[1, N, S, D]``."""
    gen = torch.Generator().manual_seed(SEED + seq)
    sbh = [torch.randn(seq, 1, HEADS * HEAD_DIM, generator=gen) for _ in range(3)]
    bnsd = [t.view(seq, 1, HEADS, HEAD_DIM).permute(1, 2, 0, 3).contiguous() for t in sbh]
    return sbh, bnsd


def _candidates(seq: int, megatron_attention) -> dict:
    """Zero-argument callables per method, each returning its own layout: SBH methods
    ``[S, 1, N*D]``, BNSD ones ``[1, N, S, D]`` (see ``_as_sbh``)."""
    (q, k, v), (qb, kb, vb) = _inputs(seq)
    mask = compressed_causal_mask(q.device)
    views = [t.view(seq, 1, HEADS, HEAD_DIM).permute(1, 2, 0, 3) for t in (q, k, v)]
    heads4d = [t.view(seq, 1, HEADS, HEAD_DIM) for t in (q, k, v)]  # [S, b, np, hn]
    kwargs = {"kernel": "reference", "atten_mask": mask, "sparse_mode": 2, "scale": SCALE}
    return {
        REFERENCE: lambda: fusion_attention(q, k, v, HEADS, "SBH", **kwargs),
        DPA: lambda: megatron_attention(*heads4d, None),
        SDPA: lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True),
        REFERENCE_BNSD: lambda: fusion_attention(qb, kb, vb, HEADS, "BNSD", **kwargs),
        SDPA_SBH_VIEWS: lambda: F.scaled_dot_product_attention(*views, is_causal=True, scale=SCALE),
        STATS: lambda: fusion_attention_with_stats(q, k, v, HEADS, "SBH", **kwargs),
    }


def _as_sbh(output) -> torch.Tensor:
    """Any method's output as ``[S, 1, N*D]`` (BNSD ``[1, N, S, D]`` is permuted; of the
    statistics path's ``(out, softmax_max, softmax_sum)`` the output)."""
    if isinstance(output, tuple):
        output = output[0]
    if output.dim() == 4:  # [1, N, S, D] -> [S, 1, N*D]
        return output.permute(2, 0, 1, 3).flatten(2)
    return output


def _repeats(seq: int) -> int:
    """Interleaved rounds: many where a call takes milliseconds, few where it takes seconds."""
    if seq <= 512:
        return 31
    return 9 if seq <= 2048 else 3


def _measure_seq(seq: int, megatron_attention) -> tuple[list[dict], float]:
    """Rows for one S, and the largest output difference to SDPA (a sanity check)."""
    compressed_causal_mask()  # the plugin's one-time 4 MiB, outside the measurement
    usage, outputs = {}, {}
    candidates = _candidates(seq, megatron_attention)
    for name, run in candidates.items():  # DPA's first call at this S: its buffer is counted
        with track_allocations() as usage[name]:
            outputs[name] = run()
    want = _as_sbh(outputs[SDPA])
    max_diff = max((_as_sbh(outputs[n]) - want).abs().max().item() for n in METHODS)
    del outputs
    seconds = interleaved_medians(candidates, repeats=_repeats(seq))
    rows = [
        {"S": seq, "method": n, "seconds": seconds[n], "peak_bytes": usage[n].peak_bytes}
        for n in METHODS
    ]
    return rows, max_diff


def _ratios(rows: list[dict], seq: int, max_diff: float) -> dict:
    by = {r["method"]: r for r in rows if r["S"] == seq}
    return {
        "S": seq,
        "reference_time_over_sdpa": by[REFERENCE]["seconds"] / by[SDPA]["seconds"],
        "reference_time_over_dpa": by[REFERENCE]["seconds"] / by[DPA]["seconds"],
        "reference_peak_over_dpa": by[REFERENCE]["peak_bytes"] / by[DPA]["peak_bytes"],
        "reference_bnsd_time_over_sdpa": by[REFERENCE_BNSD]["seconds"] / by[SDPA]["seconds"],
        "sdpa_sbh_views_time_over_sdpa": by[SDPA_SBH_VIEWS]["seconds"] / by[SDPA]["seconds"],
        "stats_time_over_sdpa": by[STATS]["seconds"] / by[SDPA]["seconds"],
        "stats_peak_over_sdpa": by[STATS]["peak_bytes"] / by[SDPA]["peak_bytes"],
        "max_abs_diff_vs_sdpa": max_diff,
    }


def measure(quick: bool = False) -> dict:
    """All methods at every S; goals at ``GOAL_SEQ`` (quick: the largest quick S)."""
    from mcore_npu.training import runtime

    seq_lens = QUICK_SEQ_LENS if quick else SEQ_LENS
    rows, ratios = [], []
    runtime.initialize(runtime.ParallelLayout(), seed=SEED)
    try:
        megatron_attention = megatron_dot_product_attention()
        for seq in seq_lens:
            seq_rows, max_diff = _measure_seq(seq, megatron_attention)
            rows += seq_rows
            ratios.append(_ratios(rows, seq, max_diff))
    finally:
        runtime.shutdown()
    goal_seq = max(seq_lens) if quick else GOAL_SEQ
    at = next(r for r in ratios if r["S"] == goal_seq)
    targets = GOALS if goal_seq == GOAL_SEQ else GOALS[:3]  # the stats goals: at S = 2048 only
    return {
        "name": "attention",
        "device": "cpu",
        "dtype": "float32",
        "shape": {"b": 1, "heads": HEADS, "head_dim": HEAD_DIM, "causal": True},
        "pass": "forward",
        "rows": rows,
        "ratios": ratios,
        "goals": [
            goal(f"{text} at S={goal_seq}", at[key], limit, kind)
            for text, key, limit, kind in targets
        ],
    }


def table(result: dict) -> str:
    """Markdown: per S, median ms and peak MiB of each method, then the goal ratios (a result
    saved before the statistics row existed: without its columns)."""
    cells = {(r["S"], r["method"]): r for r in result["rows"]}
    stats = any(r["method"] == STATS for r in result["rows"])
    methods = METHODS if stats else METHODS[:-1]
    headers = ["S", *methods, "ref/SDPA time", "ref/DPA time", "ref/DPA peak"]
    digits = dict(reference_time_over_sdpa=3, reference_time_over_dpa=3, reference_peak_over_dpa=4)
    if stats:
        headers += ["stats/SDPA time", "stats/SDPA peak"]
        digits.update(stats_time_over_sdpa=3, stats_peak_over_sdpa=3)
    body = []
    for ratio in result["ratios"]:
        row = [ratio["S"], *(_cell(cells[ratio["S"], m]) for m in methods)]
        body.append(row + [f"{ratio[key]:.{n}f}" for key, n in digits.items()])
    title = (
        "Causal self-attention, **forward only**, CPU float32, b=1, 16 heads x 64: median time "
        "and peak bytes allocated per call (outputs included).\n\n"
    )
    return title + markdown_table(headers, body)


def _cell(row: dict) -> str:
    return f"{format_seconds(row['seconds'])}, {row['peak_bytes'] / MIB:.1f} MiB"


def plot(result: dict, path) -> None:
    """Two panels vs S: time relative to SDPA, and peak bytes (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    sdpa = {r["S"]: r["seconds"] for r in result["rows"] if r["method"] == SDPA}
    for marker, method in zip("osv^Dx", METHODS):
        points = sorted((r["S"], r) for r in result["rows"] if r["method"] == method)
        xs = [s for s, _ in points]
        style = "-" if method in (REFERENCE, DPA, SDPA, STATS) else ":"
        line = {"marker": marker, "label": method}
        left.plot(xs, [r["seconds"] / sdpa[s] for s, r in points], style, **line)
        right.plot(xs, [r["peak_bytes"] / MIB for _, r in points], style, **line)
    goal_line = {"color": "gray", "linestyle": "--", "linewidth": 0.8}
    left.axhline(1.1, **goal_line, label="goal: reference <= 1.1x SDPA")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
    left.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    left.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel("sequence length S")
    left.set_ylabel("median time / SDPA (BNSD) time")
    left.set_title("Time relative to SDPA (forward, CPU fp32)")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("sequence length S")
    right.set_ylabel("peak bytes allocated per call (MiB)")
    right.set_title("Peak memory per call")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
