"""Turn a verl process into a CPU dry-run process: :func:`activate`, run in every verl process
once the switch is on (:mod:`mcore_npu.integrations.verl.cpu_runtime`).

It refuses to run next to an accelerator; sets, unless already set, :data:`ENVIRONMENT` (no Ray
usage stats, the NPU engines as on Ascend, the CPU platform); applies the CPU shims
(:func:`mcore_npu.cpu.apply`) in this thread and every later one (Ray runs actor tasks in
executor threads); makes :class:`~.platform.CpuPlatform` this process's verl platform; registers
the rollout ``hf_cpu``. Idempotent; verl, Megatron and mbridge are not patched.
"""

from __future__ import annotations

import logging
import os
import sys

from mcore_npu.allocator.device import current_accelerator

from . import platform as cpu_platform

logger = logging.getLogger(__name__)

SWITCH_MODULE = "mcore_npu.integrations.verl.cpu_runtime"
ROLLOUT = "mcore_npu.integrations.verl.cpu.rollout"
ENVIRONMENT = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "VERL_ENGINE_DEVICE": "npu",
    "VERL_ENGINE_VENDOR": "huawei",
    "VERL_PLATFORM": cpu_platform.NAME,
}


def activate() -> None:
    """Apply the CPU runtime to this process (see the module docstring). Idempotent."""
    accelerator = current_accelerator()
    if accelerator != "cpu":
        raise RuntimeError(
            f"VERL_USE_EXTERNAL_MODULES={SWITCH_MODULE}: this machine has an accelerator "
            f"({accelerator}); the CPU dry run must not run beside one. Remove "
            f"{SWITCH_MODULE} from VERL_USE_EXTERNAL_MODULES and use the recipe's own rollout."
        )
    for key, value in ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    from mcore_npu import cpu as cpu_runtime

    cpu_runtime.apply()
    cpu_runtime.apply_in_new_threads()  # Ray runs actor tasks in executor threads
    _use_platform()
    # a dry run says which engine each worker built (the engines log it at INFO)
    logging.getLogger("mcore_npu.integrations.verl").setLevel(logging.INFO)
    _register_rollout()


def _register_rollout() -> None:
    """Register ``hf_cpu``, unless :mod:`.rollout` is being imported right now.

    A Ray actor that unpickles a class of :mod:`.rollout` imports that module first; its own
    ``import verl`` runs the switch, which lands here with the module half built. The module
    then registers itself when its body ends (its last line).
    """
    half_built = sys.modules.get(ROLLOUT)
    if half_built is not None and not hasattr(half_built, "register"):
        return
    from . import rollout

    rollout.register()


def _use_platform() -> None:
    """Register :class:`CpuPlatform` and make it the platform of this process."""
    from verl.plugin.platform import PlatformRegistry, get_platform, set_platform

    if PlatformRegistry.get(cpu_platform.NAME) is not cpu_platform.CpuPlatform:
        PlatformRegistry.register(cpu_platform.NAME)(cpu_platform.CpuPlatform)
    if not isinstance(get_platform(), cpu_platform.CpuPlatform):
        set_platform(cpu_platform.CpuPlatform())
