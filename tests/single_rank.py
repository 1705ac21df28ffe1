"""One process as a one-rank Megatron job: the CPU shims, a single-rank gloo group and Megatron's
parallel state (TP = PP = CP = 1), for the session fixture ``cpu_runtime`` (tests/conftest.py)
that tests/integrations, tests/nemotron and tests/vision_hf share."""

from __future__ import annotations

import contextlib

import pytest

LAUNCH_ENV = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
}


@contextlib.contextmanager
def single_rank_megatron(master_port: int):
    """Set up as above; on exit destroy the parallel state and the group, revert the shims."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mcore_npu.training import cpu_support

    with pytest.MonkeyPatch.context() as env:
        for key, value in {**LAUNCH_ENV, "MASTER_PORT": str(master_port)}.items():
            env.setenv(key, value)
        cpu_support.apply()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        cpu_support.seed_cpu_streams(1, tp_rank=0)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
            cpu_support.revert()
