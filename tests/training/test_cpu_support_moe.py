"""The CPU shims the MoE alltoall dispatcher needs (no-op streams, numpy split sizes, the uneven
tensor-parallel gather, which tests/distributed/test_expert_parallel.py runs under EP x TP) are
installed by ``cpu_support.apply()`` and removed by ``revert()``. Runs in a child process, so
the session-wide shims of the other tests are not touched."""

from __future__ import annotations

import sys

import pytest

from tests.launch import ROOT, run_command

pytestmark = pytest.mark.cpu_only

SCRIPT = """
import torch
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.moe import token_dispatcher
from mcore_npu.training import cpu_support
original_stream, original_move = torch.cuda.Stream, token_dispatcher.maybe_move_tensor_to_cpu
original_gather = mappings._gather_along_first_dim
cpu_support.apply()
assert isinstance(mappings._gather_along_first_dim, cpu_support.UnevenGatherOnGloo)
assert mappings._gather_along_first_dim.original is original_gather
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    stream.wait_stream(torch.cuda.current_stream())
stream.record_event().synchronize()
splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
assert splits.tolist() == [3, 1] and type(splits).__module__ == "numpy", type(splits)
kept = torch.tensor([2])
assert token_dispatcher.maybe_move_tensor_to_cpu(kept) is kept
cpu_support.revert()
assert torch.cuda.Stream is original_stream
assert token_dispatcher.maybe_move_tensor_to_cpu is original_move
assert mappings._gather_along_first_dim is original_gather
print("ok")
"""


def test_alltoall_shims_apply_and_revert():
    done = run_command([sys.executable, "-c", SCRIPT], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
