"""The ``mcore-npu`` command: argument parsing and exit codes only; each subcommand's module is
imported when it runs, so ``mcore-npu --help`` works without megatron-core."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mcore_npu import __version__
from mcore_npu._warnings import hide_known_harmless_warnings

# subcommand -> (module, one-line help); each module exposes add_arguments(parser) and run(args)
_SUBCOMMANDS = {
    "train": (
        "mcore_npu.training.train",
        "train a GPT from a YAML config (CPU by default, NPU unchanged)",
    ),
    "bench": (
        "mcore_npu.tools.bench",
        "measure attention, masks, a training step, context parallelism",
    ),
    "doctor": (
        "mcore_npu.tools.doctor",
        "report on the environment: torch, megatron, torch_npu, CANN",
    ),
    "verify": ("mcore_npu.tools.verify", "run the attention case table against the kernel"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcore-npu",
        description="Megatron-Core on Ascend NPUs: fused attention spec, cached masks, "
        "expandable segments.",
    )
    parser.add_argument("--version", action="version", version=f"mcore-npu {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_module, help_text) in _SUBCOMMANDS.items():
        commands.add_parser(name, help=help_text, description=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 0
    # the command name first, then its module describes its own arguments
    if argv[0] in _SUBCOMMANDS:
        hide_known_harmless_warnings()
        module = importlib.import_module(_SUBCOMMANDS[argv[0]][0])
        sub = argparse.ArgumentParser(
            prog=f"mcore-npu {argv[0]}", description=_SUBCOMMANDS[argv[0]][1]
        )
        module.add_arguments(sub)
        return int(module.run(sub.parse_args(argv[1:])) or 0)
    parser.parse_args(argv)  # --help / --version / unknown command: argparse exits
    return 0
