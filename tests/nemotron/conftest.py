"""Fixtures for the Nemotron-H tests (``.venv-nemotron``: transformers 5.25, mbridge 0.15.1).

One process, one gloo group: ``cpu_runtime`` (session) applies the project's CPU shims
(``mcore_npu.training.cpu_support``), starts a single-rank gloo process group with Megatron's
parallel state (TP = PP = CP = 1) and, after the last test, destroys both and reverts the shims.
"""

from __future__ import annotations

import pytest

LAUNCH_ENV = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29571",
}


@pytest.fixture(scope="session")
def cpu_runtime():
    """CPU shims + a single-rank gloo group + Megatron parallel state (TP = PP = CP = 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mcore_npu.training import cpu_support

    with pytest.MonkeyPatch.context() as env:
        for key, value in LAUNCH_ENV.items():
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
