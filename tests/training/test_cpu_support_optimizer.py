"""The CPU shims for Megatron's mixed-precision optimizers and for verl's device queries:
``CudaTypeNames`` answers ``Tensor.type()`` with the CUDA name only inside the two optimizer
constructors, ``torch.cuda.mem_get_info`` / ``get_device_name`` answer for a CPU, and
``revert()`` puts every original back. Runs in a child process (the other tests' session shims
stay untouched); the optimizers themselves are exercised by ``test_train.py``'s bf16 run and by
``tests/integrations/test_loop.py`` (verl's engine)."""

from __future__ import annotations

import sys

import pytest

from tests.launch import ROOT, run_command

pytestmark = pytest.mark.cpu_only

SCRIPT = """
import torch
from megatron.core.optimizer import distrib_optimizer, optimizer
from mcore_npu.training import cpu_support
inits = (distrib_optimizer.DistributedOptimizer.__init__,
         optimizer.Float16OptimizerWithFloat16Params.__init__)
mem_get_info, get_device_name = torch.cuda.mem_get_info, torch.cuda.get_device_name
cpu_support.apply()
t = torch.zeros(2, dtype=torch.bfloat16)
assert t.type() == "torch.BFloat16Tensor"  # outside the constructors: unchanged
with cpu_support.CudaTypeNames():
    assert t.type() == "torch.cuda.BFloat16Tensor"
    assert t.float().type() == "torch.cuda.FloatTensor"
    assert torch.zeros(1, dtype=torch.int64).type() == "torch.LongTensor"  # not an optimizer's
    converted = t.type(torch.float32)  # a conversion is still a conversion
    assert converted.dtype == torch.float32 and converted.device.type == "cpu"
for cls, init in zip((distrib_optimizer.DistributedOptimizer,
                      optimizer.Float16OptimizerWithFloat16Params), inits):
    assert cls.__init__ is not init and cls.__init__.__wrapped_cpu_shim__ is init
assert torch.cuda.mem_get_info() == (0, 0) and torch.cuda.get_device_name() == "CPU"
cpu_support.revert()
assert (distrib_optimizer.DistributedOptimizer.__init__,
        optimizer.Float16OptimizerWithFloat16Params.__init__) == inits
assert torch.cuda.mem_get_info is mem_get_info and torch.cuda.get_device_name is get_device_name
print("ok")
"""


def test_optimizer_and_device_query_shims_apply_and_revert():
    done = run_command([sys.executable, "-c", SCRIPT], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
