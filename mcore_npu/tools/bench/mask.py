"""``mcore-npu bench mask``: what a causal + padding mask costs per micro-batch, on CPU.

Input: a random right-padded ``[B, S]`` keep mask (True = real token). Every builder of
:data:`METHODS` returns verl's ``[B, 1, S, S]`` bool mask, **True = masked out** (the operator's
polarity), except the plugin's causal path, which returns operator arguments and no S-sized
tensor (its cached 4 MiB compressed mask is built once per device: ``one_time_bytes``).
Memory is the peak of ``track_allocations`` over one call; time the median of interleaved calls,
with fewer repeats at large S. docs/bench.md says what each method runs.
"""

from __future__ import annotations

import torch

from mcore_npu.masks import COMPRESSED_MASKS, TopLeftCausalMask, build_npu_attention_mask
from mcore_npu.tools.bench import goal, markdown_table
from mcore_npu.tools.bench.memory import track_allocations
from mcore_npu.tools.bench.timing import interleaved_medians

SEQ_LENS = (2048, 4096, 8192, 16384)
BATCHES = (1, 4)
QUICK_SEQ_LENS = (256, 512)
QUICK_BATCHES = (1, 2)
GOAL_CASE = (4096, 4)  # (S, B) of the build_npu_attention_mask goal; quick: the largest case

MIB = 2**20
SEED = 0

VERL_BEFORE = "verl before PR 7055"
VERL_AFTER = "verl after PR 7055"
ARANGE = "arange variant"
LEAN = "build_npu_attention_mask"
PLUGIN = "plugin causal (per step)"
METHODS = (VERL_BEFORE, VERL_AFTER, ARANGE, LEAN, PLUGIN)


def verl_before_fix(keep_mask: torch.Tensor) -> torch.Tensor:
    """verl's mask before PR 7055: the causal block from float32 ones. ``keep_mask``: ``[B, S]``
    bool, True = real token; returns ``[B, 1, S, S]`` bool, True = masked out."""
    _, seq_len = keep_mask.shape
    causal_mask = torch.tril(torch.ones(seq_len, seq_len, device=keep_mask.device)).to(torch.bool)
    attn_mask = keep_mask.unsqueeze(-1) & keep_mask.unsqueeze(-2)  # [B, S, S], True = kept
    attn_mask = attn_mask & causal_mask
    return (~attn_mask).unsqueeze(1).contiguous()


def verl_after_fix(keep_mask: torch.Tensor) -> torch.Tensor:
    """verl's ``_build_npu_attn_mask`` after PR 7055 (bool ones). Shapes as ``verl_before_fix``."""
    _, seq_len = keep_mask.shape
    causal_mask = torch.tril(
        torch.ones(seq_len, seq_len, device=keep_mask.device, dtype=torch.bool)
    )  # [S, S], True = kept
    attn_mask = keep_mask.unsqueeze(-1) & keep_mask.unsqueeze(-2)  # [B, S, S], True = kept
    attn_mask = attn_mask & causal_mask
    return (~attn_mask).unsqueeze(1).contiguous()


def verl_arange(keep_mask: torch.Tensor) -> torch.Tensor:
    """verl's function with the causal block from index comparison. Shapes as above."""
    _, seq_len = keep_mask.shape
    index = torch.arange(seq_len, device=keep_mask.device)
    causal_mask = index.unsqueeze(0) <= index.unsqueeze(1)  # [S, S], [i, j] = j <= i, True = kept
    attn_mask = keep_mask.unsqueeze(-1) & keep_mask.unsqueeze(-2)  # [B, S, S], True = kept
    attn_mask = attn_mask & causal_mask
    return (~attn_mask).unsqueeze(1).contiguous()


def right_padded_keep_mask(batch: int, seq: int, seed: int = SEED) -> torch.Tensor:
    """``[B, S]`` bool, True = real token: row b keeps its first ``L_b`` tokens, L_b in [1, S]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (batch,), generator=gen)  # [B]
    return torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)


def _repeats(seq: int) -> tuple[int, int]:
    """(repeats, warmup) for interleaved timing: fewer calls where one call takes seconds."""
    if seq <= 4096:
        return 5, 1
    if seq <= 8192:
        return 3, 1
    return 1, 0  # S = 16384, B = 4: about 30 s per round of the five methods on 2 cores


def _builders(keep_mask: torch.Tensor) -> dict:
    device = keep_mask.device
    return {
        VERL_BEFORE: lambda: verl_before_fix(keep_mask),
        VERL_AFTER: lambda: verl_after_fix(keep_mask),
        ARANGE: lambda: verl_arange(keep_mask),
        LEAN: lambda: build_npu_attention_mask(keep_mask),
        PLUGIN: lambda: TopLeftCausalMask().operator_args(device),
    }


def _measure_case(seq: int, batch: int) -> list[dict]:
    """Rows for one (S, B): peak and allocated bytes of one call, median seconds."""
    keep_mask = right_padded_keep_mask(batch, seq)
    builders = _builders(keep_mask)
    usage = {}
    for name, build in builders.items():
        with track_allocations() as usage[name]:
            build()
    repeats, warmup = _repeats(seq)
    seconds = interleaved_medians(builders, repeats=repeats, warmup=warmup)
    rows = []
    for name, used in usage.items():
        row = {"S": seq, "B": batch, "method": name, "peak_bytes": used.peak_bytes}
        rows.append({**row, "allocated_bytes": used.allocated_bytes, "seconds": seconds[name]})
    return rows


def _one_time_bytes() -> int:
    """Peak bytes of the plugin's first causal call on a cold cache (the compressed mask)."""
    COMPRESSED_MASKS.clear()
    with track_allocations() as usage:
        TopLeftCausalMask().operator_args(torch.device("cpu"))
    return usage.peak_bytes


def measure(quick: bool = False) -> dict:
    """Every method at every (S, B); goals on the lean builder and the plugin's causal path."""
    seq_lens = QUICK_SEQ_LENS if quick else SEQ_LENS
    batches = QUICK_BATCHES if quick else BATCHES
    one_time = _one_time_bytes()
    rows = [row for seq in seq_lens for batch in batches for row in _measure_case(seq, batch)]
    goal_seq, goal_batch = (max(seq_lens), max(batches)) if quick else GOAL_CASE
    lean = next(r for r in rows if (r["S"], r["B"], r["method"]) == (goal_seq, goal_batch, LEAN))
    lean_ratio = lean["peak_bytes"] / (
        goal_batch * goal_seq * goal_seq
    )  # output: [B, 1, S, S] bool
    lean_goal = "build_npu_attention_mask peak / output"
    per_step = max(r["allocated_bytes"] for r in rows if r["method"] == PLUGIN)
    return {
        "name": "mask",
        "device": "cpu",
        "one_time_bytes": {"plugin causal: compressed 2048x2048 mask, once per device": one_time},
        "rows": rows,
        "goals": [
            goal(f"{lean_goal} at S={goal_seq}, B={goal_batch}", lean_ratio, 1.01, "memory"),
            goal("causal path bytes per step after warm-up", per_step, 0, "memory"),
        ],
    }


def format_seconds(seconds: float) -> str:
    """``2.36 s``, ``195 ms``, ``0.081 ms``: three significant digits at most, no exponent."""
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    milliseconds = seconds * 1e3
    return f"{milliseconds:.0f} ms" if milliseconds >= 100 else f"{milliseconds:.2g} ms"


def _cell(row: dict) -> str:
    return f"{row['peak_bytes'] / MIB:.1f} MiB, {format_seconds(row['seconds'])}"


def table(result: dict) -> str:
    """Markdown: one line per (S, B), one column per method, "peak MiB, median ms" per cell."""
    cases = sorted({(r["S"], r["B"]) for r in result["rows"]})
    cells = {(r["S"], r["B"], r["method"]): r for r in result["rows"]}
    body = [[s, b, *(_cell(cells[s, b, m]) for m in METHODS)] for s, b in cases]
    once = "; ".join(f"{k}: {v / MIB:.1f} MiB" for k, v in result["one_time_bytes"].items())
    title = (
        "Peak bytes allocated and median time per micro-batch to build the causal + padding mask "
        f"(CPU; right-padded keep mask; True = masked out). One-time cost: {once}.\n\n"
    )
    return title + markdown_table(["S", "B", *METHODS], body)


def plot(result: dict, path) -> None:
    """Log-log peak bytes vs S, one colour per method; the largest B solid, the smallest dashed;
    the plugin's one-time compressed mask dotted (its per-step 0 bytes has no log point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["B"] for r in result["rows"]})
    styles = {batches[-1]: "-", batches[0]: "--"}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, marker, method in zip(colors, "osv^D", METHODS):
        for batch, style in styles.items():
            points = sorted(
                (r["S"], r["peak_bytes"] / MIB)
                for r in result["rows"]
                if r["method"] == method and r["B"] == batch and r["peak_bytes"] > 0
            )
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, style, marker=marker, color=color, label=f"{method}, B={batch}")
    for label, nbytes in result["one_time_bytes"].items():
        ax.axhline(nbytes / MIB, linestyle=":", color="black", label=f"{label} (0 per step)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("peak bytes allocated per micro-batch (MiB)")
    ax.set_title("Causal + padding mask: peak memory per micro-batch (CPU)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
