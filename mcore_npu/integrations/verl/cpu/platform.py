"""``CpuPlatform``: the verl platform of a dry run on a machine without an accelerator.

It answers verl for a CPU torch with the CPU shims applied: ``device_name`` ``"cuda"`` (the
namespace the shims answer; ``"cpu"`` would make verl ask torch for ``cpu:gloo,cpu:gloo``, a
duplicate), vendor ``"huawei"``, backend ``"gloo"``, ``is_available`` False (no device RNG state,
no CUDA seeding), Ray resource ``"NPU"`` (``ray.init`` must declare ``resources={"NPU": n}``), no
IPC; allocator, profiler and NVTX calls are no-ops.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import torch
from verl.plugin.platform import PlatformBase

from mcore_npu.allocator.device import current_accelerator

NAME = "mcore_npu_cpu"


class CpuPlatform(PlatformBase):
    """verl's platform interface on a CPU (gloo, no IPC, the Ray resource ``NPU``)."""

    @property
    def device_name(self) -> str:
        return "cuda"

    @property
    def vendor_name(self) -> str:
        return "huawei"

    @property
    def device_module(self) -> ModuleType:
        return torch.cuda

    def is_available(self) -> bool:
        return False

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        """True only on a machine without an accelerator (the runtime registers it only there)."""
        return current_accelerator() == "cpu"

    def current_device(self):
        return torch.cuda.current_device()  # the CPU shims answer torch.device("cpu")

    def device_count(self) -> int:
        return 0

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "ASCEND_RT_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "NPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def active() -> bool:
    """Whether this platform is registered (the CPU runtime's ``activate`` has run)."""
    from verl.plugin.platform import PlatformRegistry

    return PlatformRegistry.get(NAME) is CpuPlatform
