"""Write (or, with ``--check``, check) the benchmark section of docs/figures.md.

The block between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` is generated from
``docs/bench/*.json`` (``mcore-npu bench ... --out docs/bench``) by each benchmark module's own
``table()``, so the page cannot drift from what was measured; plots are linked as
``bench/<name>.png``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
TITLES = {
    "attention": "Attention kernel (forward, CPU fp32, b=1, 16 heads, d=64, causal)",
    "mask": "Mask construction (peak bytes allocated per call; B=4 solid, B=1 dashed in the plot)",
    "step": "One training step: NPU spec (reference kernel) vs Megatron's local spec",
    "cp": "Context parallelism: one attention layer per rank (2 gloo ranks, CPU fp32, S=16384)",
}


def render(results_dir: Path) -> str:
    parts = [BEGIN, ""]
    for name, title in TITLES.items():
        path = results_dir / f"{name}.json"
        result = json.loads(path.read_text())
        module = importlib.import_module(f"mcore_npu.tools.bench.{name}")
        parts += [f"#### {title}", ""]
        if result.get("setup"):
            parts += [f"Setup: {result['setup']}.", ""]
        parts += [module.table(result), ""]
        for goal in result.get("goals", []):
            verdict = "met" if goal["met"] else "MISSED"
            measured = f"{goal['measured']} (target <= {goal['limit']})"
            parts.append(f"- goal {verdict}: {goal['text']} = {measured}")
        parts += ["", f"![{name}](bench/{name}.png)", ""]
    parts.append(END)
    return "\n".join(parts)


def splice(readme: str, block: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"the page has no {BEGIN} ... {END} block to fill")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + block + tail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcore_npu.tools.bench.readme")
    parser.add_argument("--results", default="docs/bench", type=Path)
    parser.add_argument("--page", "--readme", default="docs/figures.md", type=Path)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    current = args.page.read_text()
    wanted = splice(current, render(args.results))
    if args.check:
        if current != wanted:
            fix = "run python -m mcore_npu.tools.bench.readme"
            print(f"{args.page} is out of date with {args.results}; {fix}", file=sys.stderr)
            return 1
        return 0
    args.page.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
