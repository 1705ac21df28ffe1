"""The demo trainer on an NPU without torch_npu's ``transfer_to_npu``: the table of Megatron's
CUDA calls (``mcore_npu.training.npu_calls``) is what it does, it answers every CUDA call the
trainer's Megatron path makes, and the trainer never loads ``transfer_to_npu``.

No NPU here: ``torch.npu`` is a CPU-backed stand-in (tests/npu_module_standin.py) and the
table's device is the CPU, in fresh processes (the CPU runtime must not be applied there).
"""

from __future__ import annotations

import json
import sys

from mcore_npu.cpu import PATCHES as CPU_PATCHES
from mcore_npu.training.npu_calls import NOT_ON_NPU, PATCHES
from tests.launch import ROOT, run_command


def _keys(table) -> set:
    return {(patch.module, patch.attribute) for patch in table}


def test_each_cpu_runtime_entry_is_replaced_by_its_npu_counterpart_or_left_with_a_reason():
    """An NPU without transfer_to_npu has the CUDA-less torch.cuda of a CPU: whatever the CPU
    runtime replaces must be decided here too."""
    assert _keys(PATCHES) | set(NOT_ON_NPU) == _keys(CPU_PATCHES)
    assert not _keys(PATCHES) & set(NOT_ON_NPU)
    assert all(len(reason) > 10 for reason in NOT_ON_NPU.values())
    for patch in PATCHES:
        assert patch.how in ("value", "wrap", "new") and len(patch.reason) > 10, patch


def test_the_docs_list_every_entry_with_its_reason():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for patch in PATCHES:
        row = f"| `{patch.module}` | `{patch.attribute}` | {patch.how} | {patch.reason} |"
        assert row in text, row
    for (module, attribute), reason in NOT_ON_NPU.items():
        assert f"| `{module}` | `{attribute}` | not replaced | {reason} |" in text
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"replaces {len(CPU_PATCHES)} (" in readme
    assert f"replaces {len(PATCHES)} of Megatron's own CUDA calls" in readme


TABLE = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
import torch
from torch.overrides import _get_current_function_mode_stack as modes
from tests import npu_module_standin
from tests.patch_audit import snapshot, replaced
from mcore_npu.training import npu_calls, runtime

npu = npu_module_standin.install()
for patch in npu_calls.PATCHES:
    patch.owner()  # every module the table names is loaded before the first snapshot
before = snapshot(("torch", "megatron"))
runtime._prepare_accelerator("npu")  # what initialize() does on an NPU
during, modes_during = snapshot(("torch", "megatron")), [type(m).__name__ for m in modes()]
import megatron.core.tensor_parallel.random as mp_random
calls = {{
    "current_device": str(torch.cuda.current_device()),
    "factory": str(torch.zeros(2, device="cuda").device),
    "to": str(torch.ones(1).to("cuda:0").device),
    "cuda": str(torch.ones(1).cuda().device),
}}
torch.cuda.synchronize()
with torch.cuda.stream(torch.cuda.Stream()):
    torch.cuda.current_stream()
torch.cuda.set_device(0)
tracker = mp_random.get_cuda_rng_tracker()
tracker.add("model-parallel-rng", 7)
with tracker.fork():
    inside = torch.rand(3)
torch.manual_seed(7)
mp_random._set_cuda_rng_state(mp_random._get_cuda_rng_state())
npu_calls.revert()
after, modes_after = snapshot(("torch", "megatron")), [type(m).__name__ for m in modes()]
print(json.dumps({{"changed": replaced(before, during), "restored": replaced(before, after),
                  "modes_during": modes_during, "modes_after": modes_after, "calls": calls,
                  "npu_calls": dict(npu.calls), "forked_equals_seeded": inside.tolist()
                  == torch.rand(3).tolist(), "entries": len(before),
                  "transfer_to_npu": "torch_npu.contrib.transfer_to_npu" in sys.modules}}))
"""


def test_apply_replaces_exactly_the_table_sends_each_call_to_torch_npu_and_reverts():
    done = run_command([sys.executable, "-c", TABLE], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    table = sorted(f"{patch.module}:{patch.attribute}" for patch in PATCHES)
    assert report["changed"] == table, report["changed"]
    assert report["restored"] == [] and report["modes_after"] == []
    assert report["modes_during"] == ["CudaFactoriesOn"]
    # the trainer's device (the CPU here, npu:LOCAL_RANK on an NPU) answers for "cuda"
    assert report["calls"] == {"current_device": "cpu", "factory": "cpu", "to": "cpu",
                               "cuda": "cpu"}  # fmt: skip
    npu = report["npu_calls"]
    assert {
        "synchronize",
        "Stream",
        "stream",
        "current_stream",
        "set_device",
        "manual_seed",
    } <= set(npu)
    assert npu["get_rng_state"] >= 3 and npu["set_rng_state"] >= 2, npu
    assert report["forked_equals_seeded"]  # the tracker's stream is the stand-in generator's
    assert report["transfer_to_npu"] is False


TRAIN = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from tests import npu_module_standin
from mcore_npu import cpu as cpu_runtime
from mcore_npu.training import model, npu_calls, runtime
from mcore_npu.training.config import load_config
from mcore_npu.training.train import Trainer
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

npu = npu_module_standin.install()
portable, prepare = model._portable_fields, runtime._prepare_accelerator
# as on an NPU: Megatron initialises the weights on current_device() under the RNG tracker
model._portable_fields = lambda: {{**portable(), "use_cpu_initialization": False}}
out = Path(sys.argv[1])
losses = {{}}
for table in ("cpu", "npu"):
    if table == "npu":  # the NPU table in place of the CPU runtime, on the CPU's devices
        cpu_runtime.revert()
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None  # made anew, on the table
        runtime._prepare_accelerator = lambda accelerator: prepare("npu")
    for name, config, extra in (
        ("fp32", None, []),
        ("bf16_distopt", None, ["train.dtype=bf16", "optimizer.use_distributed_optimizer=true",
         f"train.checkpoint_dir={{out}}/{{table}}_ckpt", "train.save_interval=2"]),
        ("moe", "configs/gpt_tiny_moe.yaml", []),
        ("hybrid", "configs/gpt_tiny_hybrid.yaml", []),
    ):
        metrics = out / f"{{table}}_{{name}}.jsonl"
        cfg = load_config(config, ["train.steps=3", "train.progress=false",
                                   f"train.metrics_file={{metrics}}", *extra])
        try:
            Trainer(cfg).train()
        finally:
            runtime.shutdown()
            get_moe_layer_wise_logging_tracker().clear()  # sized by the first MoE model
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        losses[f"{{table}}_{{name}}"] = [row["loss"] for row in rows if "loss" in row]
print(json.dumps({{"losses": losses, "npu_calls": dict(npu.calls),
                  "npu_applied": npu_calls.applied(), "cpu_applied": cpu_runtime.applied(),
                  "transfer_to_npu": "torch_npu.contrib.transfer_to_npu" in sys.modules}}))
"""


def test_the_trainer_runs_on_the_npu_table_with_the_cpu_runtime_losses(tmp_path):
    """Megatron's trainer path (device-side init, fp32 and bf16 with the distributed optimizer,
    a checkpoint, MoE, the hybrid Mamba stack) calls no CUDA function the table leaves out:
    such a call raises on this CUDA-less torch, as on an NPU without transfer_to_npu. The
    losses equal the CPU runtime's because the stand-in's generator and device are the CPU's:
    this shows the calls went through the table, not how an NPU rounds."""
    done = run_command([sys.executable, "-c", TRAIN, str(tmp_path)], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    losses = report["losses"]
    print(losses, report["npu_calls"])
    for name in ("fp32", "bf16_distopt", "moe", "hybrid"):
        assert len(losses[f"cpu_{name}"]) == 3, name
        assert losses[f"npu_{name}"] == losses[f"cpu_{name}"], name
    assert report["npu_applied"] and not report["cpu_applied"]
    calls = report["npu_calls"]
    assert calls["get_rng_state"] > 0 and calls["Stream"] == 1, calls  # tracker, dispatcher
    assert report["transfer_to_npu"] is False
    assert sorted(p.name for p in (tmp_path / "npu_ckpt").iterdir())  # it saved
