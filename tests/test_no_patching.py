"""The NPU path replaces nothing of torch or Megatron: importing every module of the plugin,
building the NPU specs (dense, MoE, MLA, Gated DeltaNet), and building and running a model
forward and backward with every fused kernel through a stand-in ``torch_npu`` (no NPU here).

In a fresh process every attribute of every loaded torch and Megatron module, and of the classes
they define, is snapshotted before and after (``tests/patch_audit.py``); a function, class or
method that is no longer the same object fails the test, named. Megatron runs on the CPU here,
so the model part starts after the CPU runtime is applied (its own table,
``tests/cpu/test_patches.py``); what is compared is what the NPU path does on top of it. The
verl engines and the Hugging Face bridges: ``tests/integrations/test_no_patching.py``.
"""

from __future__ import annotations

import json
import sys

from tests.launch import ROOT, run_command

SCRIPT = f"""
import importlib, json, pkgutil, sys
sys.path.insert(0, {str(ROOT)!r})
import torch, megatron.core  # the frameworks, as a user has them loaded
from tests.patch_audit import replaced, snapshot

report = {{}}
before = snapshot()
import mcore_npu
for info in pkgutil.walk_packages(mcore_npu.__path__, "mcore_npu."):
    if not info.name.startswith("mcore_npu.integrations"):  # those need verl / mbridge
        importlib.import_module(info.name)
report["import"] = replaced(before, snapshot(), callables_only=True)

from mcore_npu.training import runtime
runtime.initialize(runtime.ParallelLayout(), seed=0)  # gloo and Megatron's state on the CPU
from tests.fused_standin import FusedOpsTorchNpu
from mcore_npu.ops import reference

class StandIn(FusedOpsTorchNpu):  # every fused operator and attention, computed by the reference
    def npu_fusion_attention(self, *args, **kwargs):
        self.calls.append(("npu_fusion_attention", args, kwargs))
        return reference.npu_fusion_attention(*args, **kwargs)

before = snapshot()
sys.modules["torch_npu"] = StandIn()
from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec
from tests.transformer import gdn_models, megatron_models, mla_models, moe_models

dense = megatron_models.tiny_config()
get_gpt_decoder_block_npu_spec(moe_models.moe_config(), kernel="torch_npu")
mla_models.npu_block(mla_models.mla_config())
gdn_models.gdn_block(gdn_models.gdn_config())
model = megatron_models.gpt(dense, get_gpt_decoder_block_npu_spec(
    dense, kernel="torch_npu", moe_permute_kernel=None, rope_kernel=None))
ids, positions = megatron_models.batch()
model(ids, positions, None).float().sum().backward()
report["npu_path"] = replaced(before, snapshot(), callables_only=True)
report["kernels"] = sorted({{call[0] for call in sys.modules["torch_npu"].calls}})
report["entries"] = len(before)
print(json.dumps(report))
"""


def test_the_npu_path_replaces_no_function_or_class_of_torch_or_megatron():
    done = run_command([sys.executable, "-c", SCRIPT], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{report['entries']} attributes of torch and Megatron compared")
    assert report["import"] == [], report["import"]
    assert report["npu_path"] == [], report["npu_path"]
    # the model ran every kernel through torch_npu (the stand-in), forward and backward
    want = {"npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"}
    assert want <= set(report["kernels"]), report["kernels"]
