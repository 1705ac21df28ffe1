"""The CPU runtime (``mcore_npu.cpu``) at its former import path, for users' scripts and tests."""

from mcore_npu.cpu import (
    FUNCTION_MODE,
    PATCHES,
    applied,
    apply,
    apply_in_new_threads,
    revert,
    seed_cpu_streams,
    seed_if_applied,
)
from mcore_npu.cpu.shims import (
    CudaFactoriesOnCpu,
    CudaTypeNames,
    UnevenGatherOnGloo,
    clip_grads_without_type_check,
    make_cpu_rng_tracker,
    splits_to_host,
)

clip_grads_on_cpu = clip_grads_without_type_check  # its name before it served the NPU too

__all__ = [
    "FUNCTION_MODE",
    "PATCHES",
    "CudaFactoriesOnCpu",
    "CudaTypeNames",
    "UnevenGatherOnGloo",
    "applied",
    "apply",
    "apply_in_new_threads",
    "clip_grads_on_cpu",
    "make_cpu_rng_tracker",
    "revert",
    "seed_cpu_streams",
    "seed_if_applied",
    "splits_to_host",
]
