"""Run under ``torchrun --nproc-per-node 2``: the fused MoE permute with expert parallelism 2.

For the alltoall and allgather dispatchers, every rank builds the tiny MoE GPT of
tests/transformer/moe_models.py twice with the same weights, ``moe_permute_kernel="reference"``
and ``"off"`` (Megatron's ``MoELayer``, unfused permute), runs its own batch forward and
backward through both, and compares logits and every gradient bit for bit. Then once more with
``"torch_npu"`` on a stand-in torch_npu (no NPU here; tests/fused_standin.py records the calls
and answers with the reference). The worst result over the ranks is taken; rank 0 prints one
``CASE {json}`` line per check.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mcore_npu.training import runtime
from tests.fused_standin import FusedOpsTorchNpu
from tests.transformer.megatron_models import batch, gpt
from tests.transformer.moe_models import moe_config, npu_moe_spec

EP = 2


def _run(config, kernel):
    model = gpt(config, npu_moe_spec(config, moe_permute_kernel=kernel))
    ids, pos = batch(b=2, s=16, seed=10 + dist.get_rank())  # each rank its own tokens
    logits = model(ids, pos, None)
    logits.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    layer = model.decoder.layers[0].mlp
    return logits.detach(), grads, type(layer).__name__, type(layer.token_dispatcher).__name__


def _mismatches(got, want) -> int:
    bad = int(not torch.equal(got[0], want[0])) + int(set(got[1]) != set(want[1]))
    return bad + sum(not torch.equal(got[1][n], g) for n, g in want[1].items() if n in got[1])


def _worst(value: int) -> int:
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def check(dispatcher):
    config = moe_config(dispatcher=dispatcher, expert_model_parallel_size=EP)
    fused, unfused = _run(config, "reference"), _run(config, "off")
    standin = FusedOpsTorchNpu()
    sys.modules["torch_npu"] = standin
    try:
        recorded = _run(config, "torch_npu")
    finally:
        del sys.modules["torch_npu"]
    names = [n for n in standin.names() if "moe_token" in n]
    expert_grads = sum(int(".experts." in n and g.abs().sum() > 0) for n, g in fused[1].items())
    return {
        "dispatcher": dispatcher,
        "mismatches": _worst(_mismatches(fused, unfused)),
        "standin_mismatches": _worst(_mismatches(recorded, unfused)),
        "layers": [fused[2], fused[3], unfused[2], unfused[3]],
        "standin_calls": names,
        "grads": len(fused[1]),
        "expert_grads": _worst(-expert_grads) * -1,  # the fewest over the ranks
        "ep_size": parallel_state.get_expert_model_parallel_world_size(),
    }


def main():
    runtime.initialize(runtime.ParallelLayout(expert=EP), seed=0)
    try:
        for dispatcher in ("alltoall", "allgather"):
            case = check(dispatcher)
            if dist.get_rank() == 0:
                print("CASE " + json.dumps(case), flush=True)
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
