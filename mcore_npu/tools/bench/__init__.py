"""``mcore-npu bench {attention,mask,step,cp,gdn,ssd,dsa}``: measurements behind docs/figures.md.

Each benchmark module has ``measure(quick) -> dict`` (JSON-able: ``name``, ``rows``, ``goals``,
...), ``table(result) -> str`` (Markdown) and ``plot(result, path)`` (a PNG); :func:`run` writes
``<out>/<name>.json`` and ``<out>/<name>.png``, prints the table and exits 1 if a goal is missed
(with ``--quick``, only a memory goal counts: the subset is too small to judge time).
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

BENCHMARKS = ("attention", "mask", "step", "cp", "gdn", "ssd", "dsa")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("which", choices=BENCHMARKS, help="what to measure")
    parser.add_argument("--out", default="bench-out", help="directory for JSON and PNG")
    parser.add_argument("--quick", action="store_true", help="a small subset (for tests)")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"mcore_npu.tools.bench.{args.which}")
    result = module.measure(quick=args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.which}.json").write_text(json.dumps(result, indent=2) + "\n")
    module.plot(result, out / f"{args.which}.png")
    print(module.table(result))
    judged = [g for g in result.get("goals", []) if not args.quick or g["kind"] == "memory"]
    missed = [g for g in judged if not g["met"]]
    for goal in result.get("goals", []):
        verdict = "met" if goal["met"] else "MISSED"
        print(f"goal {verdict}: {goal['text']} (measured {goal['measured']})")
    print(f"wrote {out / (args.which + '.json')} and {out / (args.which + '.png')}")
    return 1 if missed else 0


def goal(text: str, measured: float, limit: float, kind: str) -> dict:
    """A target ``measured <= limit`` as it appears in a result's ``goals``; ``kind``:
    ``"memory"`` (deterministic: judged in every run) or ``"time"`` (full runs only)."""
    entry = {"text": text, "measured": round(measured, 4), "limit": limit, "kind": kind}
    return {**entry, "met": measured <= limit}


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
