"""``NPUGatedDeltaNet`` at TP=2 (with and without sequence parallelism, sbhd and packed thd)
against the same layer in one process: output, input gradient and every parameter gradient.

One torchrun launch of 2 gloo ranks runs this file's ``main``: first without model parallelism
(each rank computes the one-process answer itself), then under TP=2 with each rank's shard of
the same weights (``in_proj`` rows per section ``q|k|v|z|beta|alpha``, ``conv1d`` rows per
``q|k|v``, ``A_log`` / ``dt_bias`` by value head, ``out_proj`` columns). Under SP each rank
feeds its half of the sequence and gets its half back. The fused input norm's gradient is summed
over TP as Megatron's ``finalize_model_grads`` does for ``sequence_parallel`` parameters;
``out_norm.weight``'s is summed inside the layer and must equal one process's as it is.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.megatron_features import GDN_CONFIG_FIELDS, needs_fields

TOLERANCE = 2e-5
CASES = [
    {"sequence_parallel": False, "format": "sbhd"},
    {"sequence_parallel": True, "format": "sbhd"},
    {"sequence_parallel": True, "format": "thd"},
]
LENGTHS = (6, 10, 8)  # thd: three packed sequences (24 tokens, even per SP rank)


@pytest.mark.slow
@pytest.mark.distributed
@needs_fields(*GDN_CONFIG_FIELDS, feature="Gated DeltaNet")
def test_tp2_with_and_without_sp_equals_one_process():
    from tests.launch import ROOT, TORCHRUN, run_command

    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "tests.transformer.test_gdn_tp",
    ]
    proc = run_command(cmd, cwd=ROOT, check=True, env=_env())
    reports = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("GDN ")]
    assert [(r["sequence_parallel"], r["format"]) for r in reports] == [
        (c["sequence_parallel"], c["format"]) for c in CASES
    ]
    for report in reports:
        assert report["compared"] >= 9, report  # out, dx and every parameter
        assert max(report["max_abs_error"].values()) <= TOLERANCE, report


def _env():
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# ------------------------------------------------------------------------ the worker (torchrun)
def _relayout(tensor: int):
    from megatron.core import parallel_state

    from mcore_npu.training import runtime

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    return runtime.initialize(runtime.ParallelLayout(tensor=tensor), seed=0)


def _layer(tp: int, sp: bool):
    from tests.transformer.gdn_models import gdn_config, gdn_layer

    return gdn_layer(gdn_config(tensor_model_parallel_size=tp, sequence_parallel=sp))


def _inputs(fmt: str):
    gen = torch.Generator().manual_seed(7)
    if fmt == "thd":
        return torch.randn(sum(LENGTHS), 1, 64, generator=gen), _packed()
    return torch.randn(16, 2, 64, generator=gen), None


def _packed():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))  # fmt: skip


def _run(layer, x, packed, dy):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out, _ = layer(x, None, packed_seq_params=packed)
    out.backward(dy)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


def _shard_rows(full, sections, rank, tp):
    """This TP rank's rows of a tensor whose rows are ``sections`` (each split over TP)."""
    return torch.cat([part.chunk(tp)[rank] for part in full.split(sections)])


def _shard(layer, name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    qk, v, hv = layer.qk_dim, layer.v_dim, layer.num_value_heads
    if name == "in_proj.weight":
        return _shard_rows(full, [qk, qk, v, v, hv, hv], rank, tp)
    if name == "conv1d.weight":
        return _shard_rows(full, [qk, qk, v], rank, tp)
    if name in ("A_log", "dt_bias"):
        return full.chunk(tp)[rank]
    if name == "out_proj.weight":
        return full.chunk(tp, dim=1)[rank]
    return full  # in_proj.layer_norm_weight, out_norm.weight: whole on every rank


def _case(case, reference) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp, rank = 2, dist.get_rank()
    sp = case["sequence_parallel"]
    layer = _layer(tp, sp)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(_shard(layer, name, reference["weights"][name], rank, tp))
    x, packed = _inputs(case["format"])
    out_ref, dx_ref, grads_ref = reference[case["format"]]
    dy = torch.linspace(-1, 1, out_ref.numel()).reshape(out_ref.shape)
    if sp:
        x, dy = x.chunk(tp)[rank], dy.chunk(tp)[rank]
        out_ref, dx_ref = out_ref.chunk(tp)[rank], dx_ref.chunk(tp)[rank]
    out, dx, grads = _run(layer, x, packed, dy)
    errors = {"out": (out - out_ref).abs().max().item(), "dx": (dx - dx_ref).abs().max().item()}
    group = parallel_state.get_tensor_model_parallel_group()
    for name, grad in grads.items():
        if sp and getattr(dict(layer.named_parameters())[name], "sequence_parallel", False):
            dist.all_reduce(grad, group=group)  # Megatron's finalize_model_grads
        want = _shard(layer, name, grads_ref[name], rank, tp)
        errors[name] = (grad - want).abs().max().item()
    worst = {}
    for key, value in errors.items():
        t = torch.tensor(value)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        worst[key] = t.item()
    return {**case, "compared": len(worst), "max_abs_error": worst}


def main() -> None:
    import torch.distributed as dist

    _relayout(1)
    one = _layer(1, False)
    reference = {"weights": {n: p.detach().clone() for n, p in one.named_parameters()}}
    for fmt in ("sbhd", "thd"):
        x, packed = _inputs(fmt)
        shape = one(x, None, packed_seq_params=packed)[0].shape
        dy = torch.linspace(-1, 1, shape.numel()).reshape(shape)
        reference[fmt] = _run(one, x, packed, dy)
    _relayout(2)
    for case in CASES:
        report = _case(case, reference)
        if dist.get_rank() == 0:
            print("GDN " + json.dumps(report), flush=True)
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
