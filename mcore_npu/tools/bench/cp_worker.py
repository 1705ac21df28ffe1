"""One rank of ``mcore-npu bench cp``: run under ``torchrun --nproc-per-node 2`` (gloo, CPU).

Measures one causal ``NPUFusionAttention`` layer (reference kernel, sbhd, fp32, GQA), each pass
under ``track_allocations`` and ``count_traffic``: (1) CP=1 on the whole sequence
``[S, b, np, hn]`` on rank 0 (rank 1 waits); (2) CP=2 for each comm type on both ranks, local
chunks ``[S/2, b, np, hn]``; (3) the host-synchronisation check: ``--layers`` chained layers at
``--sync-seq``, plus a positive control (``.item()`` and ``.tolist()``: the counter must see 2).
Each layer runs ``--repeats`` times: when gloo's worker thread frees a collective's buffers
varies from run to run. Rank 0 prints one line ``CPBENCH {json}`` with every rank's results.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from mcore_npu.tools.bench.memory import track_allocations
from mcore_npu.tools.bench.traffic import count_traffic

COMM_TYPES = ("p2p", "all_gather", "a2a")
CP = 2
WARMUP_SEQ = 64


def _module(args, cp: int, comm: str | None):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_npu.transformer.attention import NPUFusionAttention

    sizes = {"hidden_size": args.heads * args.head_dim, "kv_channels": args.head_dim}
    heads = {"num_attention_heads": args.heads, "num_query_groups": args.groups}
    parallel = {"context_parallel_size": cp, "cp_comm_type": comm}
    cpu = {"attention_dropout": 0.0, "use_cpu_initialization": True}
    config = TransformerConfig(num_layers=1, **sizes, **heads, **parallel, **cpu)
    return NPUFusionAttention(config, 1, AttnMaskType.causal, kernel="reference")


def _inputs(args, seq: int, seed: int):
    """Leaf q ``[seq, b, np, hn]``, k/v ``[seq, b, ng, hn]`` and dy ``[seq, b, np*hn]``."""
    gen = torch.Generator().manual_seed(seed)
    b, d = args.batch, args.head_dim
    q = torch.randn(seq, b, args.heads, d, generator=gen).requires_grad_()
    k, v = (torch.randn(seq, b, args.groups, d, generator=gen).requires_grad_() for _ in "kv")
    dy = torch.randn(seq, b, args.heads * d, generator=gen)
    return q, k, v, dy


def _measure_layer(module, args, seq: int, group_size: int, seed: int) -> dict:
    """Peak bytes and traffic of one forward and one backward at local length ``seq``."""
    q, k, v, dy = _inputs(args, seq, seed)
    with track_allocations() as fwd_mem, count_traffic(group_size) as fwd:
        out = module(q, k, v, None)
    with track_allocations() as bwd_mem, count_traffic(group_size) as bwd:
        out.backward(dy)
    inputs = {"forward": sum(_nbytes(t) for t in (q, k, v)), "backward": _nbytes(dy)}
    result = {"local_seq": seq}
    for phase, memory, traffic in (("forward", fwd_mem, fwd), ("backward", bwd_mem, bwd)):
        sizes = {"peak_bytes": memory.peak_bytes, "live_bytes": memory.live_bytes}
        result[phase] = {**sizes, "input_bytes": inputs[phase], **traffic.as_dict()}
    return result


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _chained_syncs(module, args, seq: int, layers: int, group_size: int) -> dict:
    """Forward and backward of ``layers`` chained applications of ``module``, counted: layer
    i + 1 takes layer i's output as queries and its first ``ng`` heads as keys and values."""
    q, k, v, dy = _inputs(args, seq, seed=7)
    with count_traffic(group_size) as traffic:
        x = q
        for _ in range(layers):
            out = module(x, k, v, None)
            x = out.view(seq, args.batch, args.heads, args.head_dim)
            k = v = x[:, :, : args.groups]
        out.backward(dy)
    return {"layers": layers, **traffic.as_dict()}


def _positive_control() -> int:
    """The counter on a block with exactly two host syncs (``.item()`` and ``.tolist()``)."""
    x = torch.arange(4.0)
    with count_traffic(1) as traffic:
        x.sum().item()
        x[:2].tolist()
    return sum(traffic.syncs.values())


def _warm_up(modules: dict, args) -> None:
    """One small forward/backward per module: the compressed mask cache, lazy imports."""
    for (cp, _), module in modules.items():
        if cp == 1 and dist.get_rank() != 0:
            continue
        q, k, v, dy = _inputs(args, WARMUP_SEQ // cp, seed=1)
        module(q, k, v, None).backward(dy)


def run(args) -> dict:
    modules = {(1, None): _module(args, 1, None)}
    modules.update({(CP, comm): _module(args, CP, comm) for comm in COMM_TYPES})
    _warm_up(modules, args)
    rank = dist.get_rank()
    result = {"rank": rank, "layers": {}, "sync": {}}
    if rank == 0:
        result["layers"]["cp1"] = [
            _measure_layer(modules[1, None], args, args.seq, 1, seed=3) for _ in range(args.repeats)
        ]
        syncs = _chained_syncs(modules[1, None], args, args.sync_seq, args.layers, 1)
        result["sync"]["cp1"] = syncs
    dist.barrier()
    for comm in COMM_TYPES:
        module = modules[CP, comm]
        result["layers"][comm] = [
            _measure_layer(module, args, args.seq // CP, CP, seed=3 + rank)
            for _ in range(args.repeats)
        ]
        result["sync"][comm] = _chained_syncs(module, args, args.sync_seq // CP, args.layers, CP)
    result["positive_control_syncs"] = _positive_control()
    return result


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mcore_npu.tools.bench.cp_worker")
    parser.add_argument("--seq", type=int, required=True, help="whole sequence length S")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="measurements of each layer")
    parser.add_argument("--layers", type=int, default=4, help="layers of the sync check")
    parser.add_argument("--sync-seq", type=int, default=256, help="S of the sync check")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    from mcore_npu.training import runtime

    args = parse(argv)
    runtime.initialize(runtime.ParallelLayout(context=CP), seed=0)
    try:
        mine = run(args)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if dist.get_rank() == 0:
            print("CPBENCH " + json.dumps({"args": vars(args), "ranks": everyone}), flush=True)
    finally:
        runtime.shutdown()


if __name__ == "__main__":
    main()
