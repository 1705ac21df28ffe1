"""``mcore-npu bench gdn``: the chunked gated delta rule against transformers' own.

CPU, float32, b = 1, T = 4096 (quick: 512), 4 heads, K = V = 128, in-kernel l2norm, log-decay
uniform in [-1, 0], beta uniform in (0, 1). The plugin's reference (chunk 64, its own backward)
against ``transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule`` (chunk 64,
autograd), each ``forward`` (no grad) and ``forward+backward``. transformers is optional (the
verl environment: ``.venv-verl/bin/mcore-npu bench gdn``); without it the reference alone and no
goals. Memory is the peak of ``track_allocations`` over one call; time the median of
interleaved calls.
"""

from __future__ import annotations

import importlib

import torch

from mcore_npu.ops.gated_delta import chunk_gated_delta_rule
from mcore_npu.tools.bench import goal, markdown_table
from mcore_npu.tools.bench.mask import format_seconds
from mcore_npu.tools.bench.memory import track_allocations
from mcore_npu.tools.bench.timing import interleaved_medians

TOKENS = 4096
QUICK_TOKENS = 512
HEADS = 4
HEAD_DIM = 128
MIB = 2**20
SEED = 0
REFERENCE = "reference (chunked)"
TRANSFORMERS = "transformers"
PASSES = ("forward", "forward+backward")


def transformers_rule():
    """transformers' ``torch_chunk_gated_delta_rule``, or None when transformers is missing."""
    try:
        module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    except Exception:
        return None
    return getattr(module, "torch_chunk_gated_delta_rule", None)


def _inputs(tokens: int):
    """q, k, v ``[1, T, 4, 128]``, g, beta ``[1, T, 4]`` and the upstream gradient of o."""
    gen = torch.Generator().manual_seed(SEED + tokens)
    q, k, v, do = (torch.randn(1, tokens, HEADS, HEAD_DIM, generator=gen) for _ in range(4))
    g = -torch.rand(1, tokens, HEADS, generator=gen)
    beta = torch.rand(1, tokens, HEADS, generator=gen)
    return [q, k, v, g, beta], do


def _call(method: str, rule, leaves):
    if method == REFERENCE:
        return chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True, kernel="reference")
    return rule(*leaves, chunk_size=64, use_qk_l2norm_in_kernel=True)


def _candidate(method: str, rule, inputs, do, backward: bool):
    """A zero-argument call of one method and pass, returning the output."""
    leaves = [x.clone().requires_grad_(backward) for x in inputs]

    def run():
        if not backward:
            with torch.no_grad():
                return _call(method, rule, leaves)[0]
        for leaf in leaves:
            leaf.grad = None
        out = _call(method, rule, leaves)[0]
        out.backward(do)
        return out

    return run


def measure(quick: bool = False) -> dict:
    tokens = QUICK_TOKENS if quick else TOKENS
    rule = transformers_rule()
    methods = (REFERENCE,) if rule is None else (REFERENCE, TRANSFORMERS)
    inputs, do = _inputs(tokens)
    rows, outputs = [], {}
    for pass_name in PASSES:
        backward = pass_name == "forward+backward"
        calls = {m: _candidate(m, rule, inputs, do, backward) for m in methods}
        seconds = interleaved_medians(calls, repeats=3 if quick else 5)
        for method, fn in calls.items():
            with track_allocations() as usage:
                outputs[method] = fn().detach()
            row = {"T": tokens, "pass": pass_name, "method": method, "seconds": seconds[method]}
            rows.append({**row, "peak_bytes": usage.peak_bytes})
    setup = f"CPU fp32, b=1, T={tokens}, {HEADS} heads, K=V={HEAD_DIM}, in-kernel l2norm, chunk 64"
    result = {"name": "gdn", "rows": rows, "goals": [], "transformers": bool(rule), "setup": setup}
    if rule is not None:
        result["max_abs_diff"] = (outputs[REFERENCE] - outputs[TRANSFORMERS]).abs().max().item()
        result["goals"] = _goals(rows)
    return result


def _goals(rows: list[dict]) -> list[dict]:
    cell = {(r["pass"], r["method"]): r for r in rows}
    ours, theirs = cell["forward+backward", REFERENCE], cell["forward+backward", TRANSFORMERS]
    time, peak = ours["seconds"] / theirs["seconds"], ours["peak_bytes"] / theirs["peak_bytes"]
    return [
        goal("reference fwd+bwd time / transformers' <= 1.0", time, 1.0, "time"),
        goal("reference fwd+bwd peak memory / transformers' <= 0.5", peak, 0.5, "memory"),
    ]


def table(result: dict) -> str:
    cell = {(r["pass"], r["method"]): r for r in result["rows"]}
    methods = sorted({r["method"] for r in result["rows"]}, key=[REFERENCE, TRANSFORMERS].index)
    headers = ["pass", *methods] + (["time ratio", "peak ratio"] if len(methods) == 2 else [])
    body = []
    for pass_name in PASSES:
        row = [pass_name] + [
            f"{format_seconds(cell[pass_name, m]['seconds'])}, "
            f"{cell[pass_name, m]['peak_bytes'] / MIB:.1f} MiB"
            for m in methods
        ]
        if len(methods) == 2:
            ours, theirs = cell[pass_name, REFERENCE], cell[pass_name, TRANSFORMERS]
            row.append(f"{ours['seconds'] / theirs['seconds']:.3f}")
            row.append(f"{ours['peak_bytes'] / theirs['peak_bytes']:.3f}")
        body.append(row)
    note = ""
    if not result.get("transformers"):
        note = " transformers is not installed here: the reference alone (run it in .venv-verl)."
    title = (
        f"Gated delta rule, {result['setup']}: median time and peak bytes allocated per "
        f"call (ratios: reference / transformers).{note}\n\n"
    )
    return title + markdown_table(headers, body)


def plot(result: dict, path) -> None:
    """Two bar panels per pass: median seconds and peak MiB, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    methods = sorted({r["method"] for r in result["rows"]}, key=[REFERENCE, TRANSFORMERS].index)
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        cell = {r["pass"]: r for r in result["rows"] if r["method"] == method}
        rows = [cell[p] for p in PASSES]
        xs = [x + i * width for x in range(len(PASSES))]
        left.bar(xs, [r["seconds"] for r in rows], width, label=method)
        right.bar(xs, [r["peak_bytes"] / MIB for r in rows], width, label=method)
    for axis, label in ((left, "median seconds per call"), (right, "peak MiB allocated")):
        axis.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(PASSES))])
        axis.set_xticklabels(PASSES)
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    left.set_title(f"Time ({result['setup'].split(',')[2].strip()})")
    right.set_title("Peak memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
