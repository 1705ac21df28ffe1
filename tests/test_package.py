"""The package's public shape: a light import, the console script, lazy exports, no old paths."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

import mcore_npu
from mcore_npu.cli import _SUBCOMMANDS
from tests.launch import run_command

PROBE = """
import json, sys, time
start = time.perf_counter()
import torch
torch_seconds = time.perf_counter() - start
start = time.perf_counter()
import mcore_npu
seconds = time.perf_counter() - start
heavy = [m for m in ("megatron", "torch_npu", "transformer_engine") if m in sys.modules]
print(json.dumps({"seconds": seconds, "torch_seconds": torch_seconds, "heavy": heavy}))
"""


def test_import_is_light_and_cheap():
    # best of three fresh interpreters; judged as a ratio to `import torch` timed in the same run
    # (measured: 0.4 ms against about 1 s; docs/figures.md quotes the figure)
    results = [json.loads(run_command([sys.executable, "-c", PROBE], check=True).stdout)
               for _ in range(3)]  # fmt: skip
    assert all(r["heavy"] == [] for r in results), results
    assert min(r["seconds"] / r["torch_seconds"] for r in results) < 0.05, results


def test_public_names_resolve_lazily():
    from mcore_npu.ops import fusion_attention
    from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec

    assert mcore_npu.get_gpt_layer_npu_spec is get_gpt_layer_npu_spec
    assert mcore_npu.fusion_attention is fusion_attention
    assert set(mcore_npu.__all__) <= set(dir(mcore_npu))


@pytest.mark.parametrize("name", sorted(mcore_npu._EXPORTS))
def test_every_public_name_resolves(name):
    assert getattr(mcore_npu, name) is not None


def test_version_and_help():
    out = run_command([sys.executable, "-m", "mcore_npu", "--version"], check=True).stdout
    assert out.strip() == f"mcore-npu {mcore_npu.__version__}"
    help_text = run_command([sys.executable, "-m", "mcore_npu", "--help"], check=True).stdout
    for command in _SUBCOMMANDS:
        assert command in help_text


@pytest.mark.parametrize("command", sorted(_SUBCOMMANDS))
def test_every_subcommand_has_help(command):
    out = run_command([sys.executable, "-m", "mcore_npu", command, "--help"], check=True).stdout
    assert out.startswith(f"usage: mcore-npu {command}"), out


def test_the_torchrun_launcher_name_still_works():
    out = run_command([sys.executable, "-m", "mcore_npu.train", "--help"], check=True).stdout
    assert "--config" in out


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_thing"):
        mcore_npu.no_such_thing  # noqa: B018


# removed after 0.1.0 (CHANGELOG.md): the four deprecated root aliases and the table behind them
OLD_PATHS = ("attention", "device", "layer_specs", "workers", "_moved")


@pytest.mark.parametrize("old", OLD_PATHS)
def test_the_removed_root_paths_do_not_import(old):
    with pytest.raises(ModuleNotFoundError, match=f"mcore_npu.{old}"):
        importlib.import_module(f"mcore_npu.{old}")
