"""The CPU runtime's torch function mode (``mcore_npu.cpu.shims.CudaFactoriesOnCpu``) on its own,
in a fresh interpreter (the test session runs under the CPU runtime, which enters the mode in
every thread): what it rewrites to the CPU, what it leaves alone, and that without it a CPU-only
torch refuses the same call."""

from __future__ import annotations

import subprocess
import sys

import torch

CHECK = """
import torch
from mcore_npu.cpu.shims import CudaFactoriesOnCpu

x = torch.arange(4, dtype=torch.int16)
try:
    x.to("cuda")
except (AssertionError, RuntimeError) as error:
    print("without the mode:", "CUDA" in str(error))
with CudaFactoriesOnCpu():
    made = torch.zeros(3, device="cuda:0", pin_memory=True)
    moved = x.to("cuda")  # verl: routes.to(get_device_name())
    cast = x.to(torch.device("cuda", 0), torch.int64)
    kept = x.to(torch.float32)
    same = x.cuda()
print("devices:", {t.device.type for t in (made, moved, cast, kept)})
print("values:", torch.equal(moved, x), cast.dtype, kept.dtype, same is x)
"""


def test_cuda_devices_land_on_the_cpu_and_other_calls_pass_through():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          timeout=300, check=True)  # fmt: skip
    assert done.stdout.splitlines() == [
        "without the mode: True",
        "devices: {'cpu'}",
        "values: True torch.int64 torch.float32 True",
    ], done.stdout + done.stderr


def test_the_mode_on_another_device_keeps_cuda_indices():
    """The demo trainer's NPU table enters the same mode on ``npu:LOCAL_RANK``; "meta" stands in
    for a device with indices here (no NPU), the CPU has none."""
    from mcore_npu.cpu.shims import CudaFactoriesOn

    mode = CudaFactoriesOn(torch.device("meta", 0))
    wanted = {"cuda": "meta:0", "cuda:1": "meta:1", 3: "meta:3", torch.device("cuda", 2): "meta:2"}
    assert {key: str(mode.redirect(key)) for key in wanted} == wanted
    assert str(CudaFactoriesOn(torch.device("cpu")).redirect("cuda:1")) == "cpu"
