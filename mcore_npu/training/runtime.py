"""From torchrun's environment (or a lone process) to process groups and Megatron's parallel state.

Collectives: hccl on NPU, nccl on CUDA, gloo on CPU. On a CPU ``initialize`` first applies the
CPU runtime (``mcore_npu.cpu``); on an NPU the table of Megatron's CUDA calls
(``mcore_npu.training.npu_calls``), never torch_npu's ``transfer_to_npu``.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_npu.allocator import device

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class LaunchEnv:
    """The launcher's view of this process (torchrun's variables, or a lone process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls, environ=None) -> LaunchEnv:
        env = os.environ if environ is None else environ
        try:
            return cls(
                rank=int(env.get("RANK", 0)),
                world_size=int(env.get("WORLD_SIZE", 1)),
                local_rank=int(env.get("LOCAL_RANK", 0)),
                launched="RANK" in env and "WORLD_SIZE" in env,
            )
        except ValueError as err:
            raise ValueError(
                f"RANK/WORLD_SIZE/LOCAL_RANK must be integers (as torchrun sets them): {err}"
            ) from err

    launched: bool = False  # a launcher set RANK and WORLD_SIZE (torchrun does, even for 1)


@dataclass(frozen=True)
class ParallelLayout:
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    expert_tensor: int | None = None  # expert layers' tensor parallel; None = tensor


@dataclass(frozen=True)
class Runtime:
    """What ``initialize`` set up."""

    accelerator: str
    backend: str
    device: torch.device
    launch: LaunchEnv
    layout: ParallelLayout

    @property
    def is_logging_rank(self) -> bool:
        """The one rank that prints progress and writes metrics (global rank 0)."""
        return self.launch.rank == 0


def initialize(layout: ParallelLayout, *, seed: int, timeout_s: float = 300.0) -> Runtime:
    """Process groups, device and Megatron parallel state for this process (data parallel: what
    ``layout`` leaves of the world size; ``timeout_s``: so a dead peer ends the run)."""
    from megatron.core import parallel_state

    accelerator = device.current_accelerator()
    launch = LaunchEnv.from_environ()
    _prepare_accelerator(accelerator)
    backend = BACKENDS[accelerator]
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if launch.launched:
            dist.init_process_group(backend, timeout=timeout)
        else:  # a lone process needs no rendezvous port
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    if parallel_state.model_parallel_is_initialized():  # a second trainer in this process
        _check_same_layout(layout)
    else:
        _initialize_parallel_state(layout)
    runtime = Runtime(accelerator, backend, device.current_device(), launch, layout)
    seed_streams(seed)
    return runtime


def _initialize_parallel_state(layout: ParallelLayout) -> None:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        context_parallel_size=layout.context,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor,
    )


def _check_same_layout(layout: ParallelLayout) -> None:
    from megatron.core import parallel_state

    current = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
    )
    wanted = (layout.tensor, layout.pipeline, layout.context)
    if current != wanted:
        raise RuntimeError(
            f"Megatron's parallel state already exists with tensor/pipeline/context sizes "
            f"{current}, not {wanted}; call mcore_npu.training.runtime.shutdown() first"
        )


def select_device() -> torch.device:
    """Make ``cuda:LOCAL_RANK`` / ``npu:LOCAL_RANK`` current (allocates nothing); CPU: no-op.
    Call it first: the NPU allocator setter acts on the current device."""
    accelerator = device.current_accelerator()
    local_rank = LaunchEnv.from_environ().local_rank
    if accelerator == "npu":
        torch.npu.set_device(local_rank)
    elif accelerator == "cuda":
        torch.cuda.set_device(local_rank)
    return device.current_device()


def _prepare_accelerator(accelerator: str) -> None:
    select_device()
    if accelerator == "cpu":
        from mcore_npu import cpu as cpu_runtime

        cpu_runtime.apply()
    elif accelerator == "npu":
        from mcore_npu.training import npu_calls

        npu_calls.apply(device.current_device())


def seed_streams(seed: int) -> None:
    """Seed torch and Megatron's data-, model- and expert-parallel RNG streams from ``seed``."""
    from megatron.core import parallel_state

    if device.current_accelerator() == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
        return
    from mcore_npu import cpu as cpu_runtime  # the tracker in place: the CPU's or the NPU's

    cpu_runtime.seed_tracker(
        seed,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
    )


def shutdown() -> None:
    """Destroy Megatron's parallel state and the process group (safe twice; imports nothing)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
