"""``CpuPlatform``: the verl platform of a dry run on a machine without an accelerator.

verl resolves one platform per process (``verl.plugin.platform.get_platform``) and asks it for the
device module, the collective backend, the Ray resource and the IPC / allocator abilities. This
one answers for a CPU torch on which :func:`mcore_npu.training.cpu_support.apply` has run:

=============================  ==============================================================
verl asks                      answer
=============================  ==============================================================
``device_name``                ``"cuda"``: the namespace the project's CPU shims answer for
                               (``torch.cuda.current_device()`` is the CPU there); ``"cpu"``
                               would make verl ask for ``cpu:gloo,cpu:gloo``, which torch
                               refuses as a duplicate device
``vendor_name``                ``"huawei"``
``communication_backend_name`` ``"gloo"`` (verl asks ``cpu:gloo,cuda:gloo``)
``is_available``               False: no device, so verl keeps no device RNG state in its
                               checkpoints and skips its CUDA seeding
``ray_resource_name``          ``"NPU"``: the workers are placed as on Ascend (``ray.init`` must
                               declare ``resources={"NPU": n}``, e.g.
                               ``+ray_kwargs.ray_init.resources={NPU:2}``)
``is_ipc_supported``           False; allocator settings, profiler, NVTX: no-ops
=============================  ==============================================================

The engine is still chosen as on Ascend (``("npu", "huawei")``): the runtime exports
``VERL_ENGINE_DEVICE=npu`` / ``VERL_ENGINE_VENDOR=huawei`` (:mod:`.runtime`).
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
    """Whether the CPU runtime's ``activate`` has run in this process (this platform is
    registered)."""
    from verl.plugin.platform import PlatformRegistry

    return PlatformRegistry.get(NAME) is CpuPlatform
