"""The package's public shape: a light import, the console script, lazy exports."""

from __future__ import annotations

import json
import subprocess
import sys

import mcore_npu

PROBE = """
import json, sys, time
import torch
start = time.perf_counter()
import mcore_npu
seconds = time.perf_counter() - start
heavy = [m for m in ("megatron", "torch_npu", "transformer_engine") if m in sys.modules]
print(json.dumps({"seconds": seconds, "heavy": heavy}))
"""


def test_import_is_light_and_cheap():
    # best of three fresh interpreters: the figure is the import itself, not a cold disk cache
    results = [json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True,
                                         text=True, check=True).stdout) for _ in range(3)]  # fmt: skip
    assert all(r["heavy"] == [] for r in results), results
    assert min(r["seconds"] for r in results) < 0.3, results


def test_public_names_resolve_lazily():
    from mcore_npu.layer_specs import get_gpt_layer_npu_spec
    from mcore_npu.ops import fusion_attention

    assert mcore_npu.get_gpt_layer_npu_spec is get_gpt_layer_npu_spec
    assert mcore_npu.fusion_attention is fusion_attention
    assert set(mcore_npu.__all__) <= set(dir(mcore_npu))


def test_version_and_help():
    out = subprocess.run([sys.executable, "-m", "mcore_npu", "--version"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert out.strip() == f"mcore-npu {mcore_npu.__version__}"
    help_text = subprocess.run([sys.executable, "-m", "mcore_npu", "--help"], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    for command in ("train", "bench", "doctor", "verify"):
        assert command in help_text


def test_unknown_attribute_is_an_attribute_error():
    try:
        mcore_npu.no_such_thing  # noqa: B018
    except AttributeError as err:
        assert "no_such_thing" in str(err)
    else:
        raise AssertionError("expected AttributeError")
