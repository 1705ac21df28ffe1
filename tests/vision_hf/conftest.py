"""Fixtures for the Qwen3-VL tests against transformers (run by ``make test-verl``, transformers
5.10.4, and ``make test-nemotron``, transformers 5.25; ``make test`` has no transformers).

One process, one gloo group: ``cpu_runtime`` (session) applies the project's CPU shims, starts a
single-rank gloo group with Megatron's parallel state (TP = PP = CP = 1) and undoes both after the
last test."""

from __future__ import annotations

import pytest

from tests.single_rank import single_rank_megatron


@pytest.fixture(scope="session")
def cpu_runtime():
    """CPU shims + a single-rank gloo group + Megatron parallel state (TP = PP = CP = 1)."""
    with single_rank_megatron(29581):
        yield
