"""The fused MoE permute under expert parallelism 2 (torchrun, 2 gloo ranks): one launch of
``moe_permute_ep.py`` checks the alltoall and allgather dispatchers, each with
``moe_permute_kernel="reference"`` and ``"torch_npu"`` (on a stand-in torch_npu: no NPU here),
against Megatron's ``MoELayer`` with its unfused permute, bit for bit."""

from __future__ import annotations

import json
import os

import pytest

from tests.launch import ROOT, TORCHRUN, run_command

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def cases():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    script = ROOT / "tests" / "distributed" / "moe_permute_ep.py"
    proc = run_command([str(TORCHRUN), "--standalone", "--nproc-per-node=2", str(script)],
                       cwd=ROOT, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CASE ")]
    return {case["dispatcher"]: case for case in found}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_ep2_fused_permute_equals_megatrons_unfused_permute(cases, dispatcher):
    case = cases[dispatcher]
    assert case["ep_size"] == 2
    prefix = "AlltoAll" if dispatcher == "alltoall" else "AllGather"
    assert case["layers"] == ["NPUMoELayer", f"NPU{prefix}TokenDispatcher", "MoELayer",
                              f"MoE{prefix}TokenDispatcher"]  # fmt: skip
    assert case["mismatches"] == 0 and case["standin_mismatches"] == 0
    assert case["grads"] > 0 and case["expert_grads"] == 2 * 2 * 2  # layers x local experts x fc
    per_layer = ["npu_moe_token_permute_with_routing_map",
                 "npu_moe_token_unpermute_with_routing_map"]  # fmt: skip
    assert case["standin_calls"] == per_layer * 2
