"""An operator's reference against transformers' pure-torch version of it, side by side.

A :class:`Contest` names the two calls and their inputs; :func:`measure` times both, interleaved,
for ``forward`` (no grad) and ``forward+backward``, and takes each one's peak memory from
``track_allocations`` over one call. Without transformers (or without the function) it measures
the reference alone and judges no goal. ``bench gdn`` and ``bench ssd`` are contests.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore_npu.tools.bench import goal, markdown_table
from mcore_npu.tools.bench.mask import format_seconds
from mcore_npu.tools.bench.memory import track_allocations
from mcore_npu.tools.bench.timing import interleaved_medians

MIB = 2**20
REFERENCE = "reference (chunked)"
TRANSFORMERS = "transformers"
PASSES = ("forward", "forward+backward")


@dataclass(frozen=True)
class Contest:
    """``inputs(tokens) -> (leaves, upstream gradient)``; ``ours(leaves)`` / ``theirs(fn,
    leaves)`` return the output; ``theirs_at`` is ``"module:function"`` in transformers;
    ``setup`` describes the call with ``{tokens}`` in it; ``where``: the environment that has
    a transformers with that function."""

    name: str
    title: str
    setup: str
    inputs: Callable
    ours: Callable
    theirs: Callable
    theirs_at: str
    where: str
    tokens: int = 4096
    quick_tokens: int = 512


def transformers_function(contest: Contest):
    """transformers' function of ``contest``, or None when it does not import."""
    module, _, name = contest.theirs_at.partition(":")
    try:
        return getattr(importlib.import_module(module), name, None)
    except Exception:
        return None


def _candidate(call, inputs, upstream, backward: bool):
    """A zero-argument call of one method and pass, returning the output."""
    leaves = [x.clone().requires_grad_(backward) for x in inputs]

    def run():
        if not backward:
            with torch.no_grad():
                return call(leaves)
        for leaf in leaves:
            leaf.grad = None
        out = call(leaves)
        out.backward(upstream)
        return out

    return run


def measure(contest: Contest, quick: bool = False) -> dict:
    tokens = contest.quick_tokens if quick else contest.tokens
    fn = transformers_function(contest)
    methods = {REFERENCE: contest.ours}
    if fn is not None:
        methods[TRANSFORMERS] = lambda leaves: contest.theirs(fn, leaves)
    inputs, upstream = contest.inputs(tokens)
    rows, outputs = [], {}
    for pass_name in PASSES:
        backward = pass_name == "forward+backward"
        calls = {m: _candidate(c, inputs, upstream, backward) for m, c in methods.items()}
        seconds = interleaved_medians(calls, repeats=3 if quick else 5)
        for method, run in calls.items():
            with track_allocations() as usage:
                outputs[method] = run().detach()
            row = {"T": tokens, "pass": pass_name, "method": method, "seconds": seconds[method]}
            rows.append({**row, "peak_bytes": usage.peak_bytes})
    setup = contest.setup.format(tokens=tokens)
    result = {
        "name": contest.name,
        "title": contest.title,
        "rows": rows,
        "goals": [],
        "transformers": fn is not None,
        "setup": setup,
        "where": contest.where,
    }
    if fn is not None:
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


def _methods(result: dict) -> list[str]:
    return sorted({r["method"] for r in result["rows"]}, key=[REFERENCE, TRANSFORMERS].index)


def table(result: dict) -> str:
    cell = {(r["pass"], r["method"]): r for r in result["rows"]}
    methods = _methods(result)
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
        note = f" transformers' version is not installed here: the reference alone ({result['where']})."
    title = (
        f"{result['title']}, {result['setup']}: median time and peak bytes allocated per "
        f"call (ratios: reference / transformers).{note}\n\n"
    )
    return title + markdown_table(headers, body)


def plot(result: dict, path) -> None:
    """Two bar panels per pass: median seconds and peak MiB, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    methods = _methods(result)
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
    left.set_title(f"{result['title']}: time (T={result['rows'][0]['T']})")
    right.set_title("Peak memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
