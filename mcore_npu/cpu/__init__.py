"""The CPU runtime: Megatron-Core and verl on a machine without an accelerator (gloo).

What it replaces is one table, :data:`PATCHES` (docs/architecture.md); ``apply()`` installs it,
``revert()`` puts every original object back. It refuses to run next to an accelerator.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field

from mcore_npu.allocator.device import current_accelerator
from mcore_npu.cpu.patches import FUNCTION_MODE, PATCHES, Patch, install, restore

__all__ = [
    "FUNCTION_MODE",
    "PATCHES",
    "Patch",
    "applied",
    "apply",
    "apply_in_new_threads",
    "revert",
    "seed_cpu_streams",
    "seed_if_applied",
    "seed_tracker",
]


@dataclass
class _State:
    originals: list = field(default_factory=list)  # per entry of PATCHES, in order
    mode: object = None
    threads: bool = False  # apply_in_new_threads() is on


_STATE = _State()


def applied() -> bool:
    """Whether ``apply()`` is in effect in this process."""
    return _STATE.mode is not None


def apply() -> None:
    """Install :data:`PATCHES` and enter :data:`FUNCTION_MODE` (idempotent; ``RuntimeError``
    on a machine with an accelerator)."""
    if applied():
        return
    accelerator = current_accelerator()
    if accelerator != "cpu":
        raise RuntimeError(
            f"mcore_npu.cpu.apply(): this machine has an accelerator ({accelerator}); the CPU "
            "runtime must never be active next to one. Run on the accelerator instead."
        )
    _STATE.originals = install(PATCHES)
    _STATE.mode = FUNCTION_MODE[0]()
    _STATE.mode.__enter__()


def revert() -> None:
    """Undo ``apply()``: every replaced attribute is its original object again."""
    if not applied():
        return
    if _STATE.threads:
        threading.setprofile(None)
        _STATE.threads = False
    _STATE.mode.__exit__(None, None, None)
    restore(PATCHES, _STATE.originals)
    _STATE.originals = []
    _STATE.mode = None


def apply_in_new_threads() -> None:
    """Enter :data:`FUNCTION_MODE` in every thread started from now on (the mode is
    thread-local; a Ray actor runs its tasks in later threads). ``revert()`` stops it."""
    if not applied():
        raise RuntimeError("mcore_npu.cpu.apply_in_new_threads(): call apply() first")
    threading.setprofile(_enter_mode_in_thread)
    _STATE.threads = True


def _enter_mode_in_thread(frame, event, arg) -> None:
    """The one-shot profile hook of a new thread: enter the mode, unhook."""
    sys.setprofile(None)
    if applied():
        FUNCTION_MODE[0]().__enter__()


def seed_if_applied(seed: int) -> bool:
    """Where the runtime is applied, :func:`seed_tracker` with this process's Megatron ranks
    (Megatron seeds its tracker only on a device); returns whether it seeded."""
    if not applied():
        return False
    from megatron.core import parallel_state as mpu

    seed_tracker(
        seed,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        ep_rank=mpu.get_expert_model_parallel_rank(),
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
    )
    return True


def seed_tracker(seed: int, *, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Seed torch and the three named streams of the RNG tracker in place (this runtime's, or
    the demo trainer's NPU one) as Megatron seeds CUDA's."""
    import torch
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add("data-parallel-rng", seed)
    tracker.add("model-parallel-rng", seed + 2718 + tp_rank)
    tracker.add("expert-parallel-rng", seed + 1024 + 100 * ep_rank + etp_rank)


seed_cpu_streams = seed_tracker  # its name from when only the CPU runtime had a tracker
