"""Session fixtures shared by the torchrun modules: one step-0 checkpoint and one one-process
reference run of ``gpt_tiny.yaml`` (tests/distributed/runs.py), each launched once."""

from __future__ import annotations

import pytest

from tests.distributed.runs import BATCH
from tests.launch import assert_ok, train


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("reference")


@pytest.fixture(scope="session")
def initial(reference_dir):
    """A step-0 checkpoint every parallel run starts from."""
    assert_ok(train(["train.steps=0", f"train.checkpoint_dir={reference_dir / 'init'}"]))
    return reference_dir / "init"


@pytest.fixture(scope="session")
def single(reference_dir, initial):
    """The one-process run every parallel layout must reproduce."""
    return assert_ok(
        train([*BATCH, f"train.init_from={initial}"], metrics=reference_dir / "single.jsonl")
    )
