"""The verl and Hugging Face side of the NPU path replaces nothing of torch, Megatron, verl,
mbridge or transformers: loading the ``verl.plugins`` entry point, registering the engines when
verl's engine registry is imported, and loading, running and exporting checkpoints through
``npu_bridge`` (Qwen3-MoE through mbridge's bridge, DeepSeek-V3 and Qwen3.5 through the
plugin's). As in ``tests/test_no_patching.py``: a fresh process, every attribute of every
loaded module of those packages and of their classes compared before and after; entries that
verl's and mbridge's registries gain through their own hooks are allowed, a replaced function,
class or method is not. Megatron runs on the CPU here: the CPU runtime is applied first.
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("verl")

from tests.launch import ROOT, run_command

SCRIPT = """
import json, os, sys
sys.path.insert(0, {root!r})
import torch, megatron.core, mbridge, transformers, verl  # what a verl user has loaded
from mcore_npu.training import runtime
runtime.initialize(runtime.ParallelLayout(), seed=0)  # gloo and Megatron's state on the CPU
from tests.patch_audit import replaced, snapshot

before = snapshot()
import verl.workers.engine as registry  # the plugin registers the engines right after it
from verl.workers.engine.base import EngineRegistry
loader = type(registry.__loader__).__name__, type(registry.__spec__.loader).__name__
engines = EngineRegistry._engines["language_model"]["megatron"].get(("npu", "huawei"))
from mcore_npu.integrations.hf import build_model, export_hf_weights, load_hf_weights, npu_bridge
for path in {paths!r}:
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(name, None)  # Megatron asserts one attention backend per process
    bridge = npu_bridge(path, kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(bias_dropout_fusion=False, masked_softmax_fusion=False)
    model = build_model(bridge)
    load_hf_weights(model, path, bridge=bridge)
    ids = torch.randint(0, 128, (1, 12))
    model(ids, torch.arange(12)[None], None).sum().backward()
    exported = dict(export_hf_weights(model, bridge))
print(json.dumps({{"replaced": replaced(before, snapshot(), callables_only=True),
                  "engine": getattr(engines, "__name__", None), "loaders": loader,
                  "entries": len(before)}}))
"""


def test_verl_registration_and_the_bridges_replace_nothing(
    qwen3_moe, tiny_deepseek_v3_model, qwen3_5_hub, own_attention_variables
):
    paths = [qwen3_moe, tiny_deepseek_v3_model, qwen3_5_hub]
    script = SCRIPT.format(root=str(ROOT), paths=paths)
    done = run_command([sys.executable, "-c", script], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{report['entries']} attributes of torch, Megatron, verl, mbridge and transformers")
    assert report["replaced"] == [], report["replaced"]
    assert report["engine"] == "NPUMegatronEngineWithLMHead"  # registered, through the hook
    assert report["loaders"] == ["SourceFileLoader", "SourceFileLoader"]  # verl's own, back
