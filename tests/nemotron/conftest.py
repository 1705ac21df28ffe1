"""Fixtures for the Nemotron-H tests (``.venv-nemotron``: transformers 5.25, mbridge 0.15.1).

One process, one gloo group: ``cpu_runtime`` (session) applies the project's CPU shims
(``mcore_npu.training.cpu_support``), starts a single-rank gloo process group with Megatron's
parallel state (TP = PP = CP = 1) and, after the last test, destroys both and reverts the shims.
"""

from __future__ import annotations

import pytest

from tests.single_rank import single_rank_megatron


@pytest.fixture(scope="session")
def cpu_runtime():
    """CPU shims + a single-rank gloo group + Megatron parallel state (TP = PP = CP = 1)."""
    with single_rank_megatron(29571):
        yield
