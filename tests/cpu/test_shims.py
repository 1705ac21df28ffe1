"""The CPU runtime's torch function mode (``mcore_npu.cpu.shims.CudaFactoriesOnCpu``) on its own:
what it rewrites to the CPU, and that it leaves every other call as it was."""

from __future__ import annotations

import torch

from mcore_npu.cpu.shims import CudaFactoriesOnCpu


def test_cuda_devices_land_on_the_cpu_and_other_calls_pass_through():
    x = torch.arange(4, dtype=torch.int16)
    with CudaFactoriesOnCpu():
        made = torch.zeros(3, device="cuda:0", pin_memory=True)
        moved = x.to("cuda")  # verl: routes.to(get_device_name())
        cast = x.to(torch.device("cuda", 0), torch.int64)
        kept = x.to(torch.float32)
        same = x.cuda()
    assert made.device.type == moved.device.type == cast.device.type == "cpu"
    assert torch.equal(moved, x) and cast.dtype == torch.int64 and kept.dtype == torch.float32
    assert same is x
    try:
        x.to("cuda")  # outside the mode torch itself answers
    except (AssertionError, RuntimeError) as error:
        assert "CUDA" in str(error)
    else:
        raise AssertionError("a CPU-only torch moved a tensor to 'cuda' without the mode")
