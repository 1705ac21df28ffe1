"""The Gated DeltaNet's context-parallel all-to-all
(mcore_npu.transformer.gated_delta_net.context_parallel) against one process: :func:`cases`
and :func:`refusals`, run inside the CP=2 and CP=4 launches of ``cp_attention.py`` (no launch
of its own); ``torchrun --nproc-per-node N tests/distributed/gdn_cp.py`` runs them alone.

Every rank computes the one-process answer itself (the GDN core on the whole sequence with all
heads, no collective), then the CP path on its own chunks as Megatron cuts them (sbhd:
``get_batch_on_this_cp_rank``; packed thd: ``thd_get_partitioned_indices``): scatter_heads ->
the core on its heads with its channels of conv1d / A_log / dt_bias -> gather_heads. It compares
the output and the input gradient of its chunks, and the parameter gradients summed over the
CP ranks (what Megatron's gradient all-reduce over data x context parallel does); rank 0 prints
one JSON line per case (``GDN_CASE {...}``) and the refusals (``GDN_REFUSALS {...}``).

The core is written here from the plugin's operators (``mcore_npu.ops.gated_delta``), in
Megatron 0.16.1's GatedDeltaNet order: conv -> l2norm(q, k) -> g, beta -> rule -> gated norm.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.utils import get_batch_on_this_cp_rank

from mcore_npu.ops.gated_delta import causal_conv1d, chunk_gated_delta_rule, gated_rms_norm, l2norm
from mcore_npu.training import runtime
from mcore_npu.transformer.context_parallel import thd_get_partitioned_indices
from mcore_npu.transformer.gated_delta_net import context_parallel as gdn_cp

WIDTH = 4  # conv kernel


def _params(hk, hv, dk, dv, gen):
    conv_dim = 2 * hk * dk + hv * dv
    return {
        "conv": torch.randn(conv_dim, 1, WIDTH, generator=gen) * 0.5,
        "A_log": torch.rand(hv, generator=gen).add(1).log(),
        "dt_bias": torch.randn(hv, generator=gen) * 0.5,
        "norm": 1 + 0.1 * torch.randn(dv, generator=gen),
    }


def core(x, params, hk, hv, dk, dv, cu_seqlens=None):
    """One process's GDN between in_proj and out_proj: ``[s, b, D]`` -> ``[s, b, HV * V]``,
    D = 2*H*K + 2*HV*V + 2*HV (thd: ``[t, 1, D]`` with ``cu_seqlens``)."""
    s, b, _ = x.shape
    qkv, z, beta, alpha = torch.split(x.transpose(0, 1), [2 * hk * dk + hv * dv, hv * dv, hv, hv],
                                      dim=-1)  # fmt: skip
    qkv = causal_conv1d(qkv, params["conv"], cu_seqlens=cu_seqlens)
    q, k, v = torch.split(qkv, [hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = l2norm(q.reshape(b, s, hk, dk)), l2norm(k.reshape(b, s, hk, dk))
    g = -params["A_log"].float().exp() * F.softplus(alpha.float() + params["dt_bias"])
    out, _ = chunk_gated_delta_rule(q, k, v.reshape(b, s, hv, dv), g, beta.sigmoid(),
                                    cu_seqlens=cu_seqlens)  # fmt: skip
    out = gated_rms_norm(out, z.reshape(b, s, hv, dv), params["norm"])
    return out.reshape(b, s, hv * dv).transpose(0, 1)


def _local_params(params, hk, hv, dk, dv, cp):
    """This CP rank's rows of conv1d / A_log / dt_bias, cut as NPUGatedDeltaNet cuts them from
    ``cp.heads``; ``norm`` (per value-head dim) is whole on every rank."""
    ks, vs = cp.heads(hk), cp.heads(hv)
    q, k, v = params["conv"].split([hk * dk, hk * dk, hv * dv])
    conv = torch.cat([q[ks.start * dk : ks.stop * dk], k[ks.start * dk : ks.stop * dk],
                      v[vs.start * dv : vs.stop * dv]])  # fmt: skip
    return {"conv": conv, "A_log": params["A_log"][vs], "dt_bias": params["dt_bias"][vs],
            "norm": params["norm"]}  # fmt: skip


def _leaves(params):
    return {name: p.clone().requires_grad_() for name, p in params.items()}


def check(hk, hv, dk, dv, *, layout="sbhd", seq=16, batch=2, padded=None, real=None):
    """One case: ``layout`` sbhd ``[seq, batch]`` or thd (``padded`` lengths, packed)."""
    group = _cp_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(7 + hk + 3 * hv)
    params = _params(hk, hv, dk, dv, gen)
    sections = [(hk, dk), (hk, dk), (hv, dv), (hv, dv), (hv, 1), (hv, 1)]  # q k v z beta alpha
    packed = layout == "thd"
    total = sum(padded) if packed else seq
    x = torch.randn(total, 1 if packed else batch, sum(n * d for n, d in sections), generator=gen)
    dy = torch.randn(total, x.shape[1], hv * dv, generator=gen)
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()]) if packed else None
    if packed and real is not None:  # padding positions: no loss, so no upstream gradient
        keep = torch.cat([torch.arange(p) < r for r, p in zip(real, padded)])
        dy = dy * keep[:, None, None]
    index = (thd_get_partitioned_indices(cu, total, size, rank) if packed
             else _zigzag_index(total))  # fmt: skip

    one = _leaves(params)
    x_one = x.clone().requires_grad_()
    y_one = core(x_one, one, hk, hv, dk, dv, cu)
    y_one.backward(dy)

    mine = _leaves(params)
    x_mine = x.index_select(0, index).clone().requires_grad_()
    cp = gdn_cp.GDNContextParallel(group)
    batch_params = _PackedStub(cu) if packed else None
    heads = cp.to_heads(x_mine, sections, batch_params)  # [s, b, C/CP], natural order
    out = core(heads, _local_params(mine, hk, hv, dk, dv, cp), hk // size, hv // size, dk, dv,
               cu)  # fmt: skip
    y_mine = cp.to_sequence(out, batch_params)
    y_mine.backward(dy.index_select(0, index))
    for leaf in mine.values():
        dist.all_reduce(leaf.grad, group=group)  # the DDP gradient sum over CP

    rows = index if real is None else index[keep.index_select(0, index)]
    got = {"out": y_mine.detach().index_select(0, _positions(index, rows)), "dx": x_mine.grad,
           **{f"d{name}": mine[name].grad for name in params}}  # fmt: skip
    want = {"out": y_one.detach().index_select(0, rows), "dx": x_one.grad.index_select(0, index),
            **{f"d{name}": one[name].grad for name in params}}  # fmt: skip
    errors = torch.tensor([[(got[n] - want[n]).abs().max(), want[n].abs().max()] for n in got])
    dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=group)  # worst over the ranks
    return {"layout": layout, "cp": size, "key_heads": hk, "value_heads": hv, "key_dim": dk,
            "value_dim": dv, "padded": padded, "real": real,
            "max_abs_error": dict(zip(got, errors[:, 0].tolist())),
            "max_abs_value": dict(zip(got, errors[:, 1].tolist()))}  # fmt: skip


class _PackedStub:
    """The fields of Megatron's ``PackedSeqParams`` that the CP seam reads (global offsets)."""

    qkv_format = "thd"

    def __init__(self, cu):
        self.cu_seqlens_q_padded = self.cu_seqlens_q = cu.to(torch.int32)


def _zigzag_index(seq):
    """The token indices this CP rank keeps of ``seq`` tokens: Megatron's own split
    (``get_batch_on_this_cp_rank``, chunks r and 2CP-1-r) of ``arange(seq)``."""
    return get_batch_on_this_cp_rank({"tokens": torch.arange(seq)[None]})["tokens"][0]


def _positions(index, rows):
    """Where each of ``rows`` (global token ids) sits in ``index``."""
    where = {int(t): i for i, t in enumerate(index)}
    return torch.tensor([where[int(t)] for t in rows], dtype=torch.long)


def _cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def refusals():
    """The ValueErrors of bad head counts, sections, local lengths and packed lengths."""
    group = _cp_group()
    size = dist.get_world_size(group)
    found = {}
    cp = gdn_cp.GDNContextParallel(group)
    attempts = {
        "heads": lambda: cp.to_heads(torch.zeros(4, 1, 18), [(3, 2), (3, 4)], None),
        "odd_chunk": lambda: gdn_cp.scatter_heads(torch.zeros(3, 1, 8), (4, 4), group),
        "sections": lambda: gdn_cp.scatter_heads(torch.zeros(4, 1, 8), (3, 5), group),
        "thd_length": lambda: gdn_cp.packed_local_ends(
            _PackedStub(torch.tensor([0, 6, 14])), size, 7),
    }  # fmt: skip
    for name, attempt in attempts.items():
        try:
            attempt()
            found[name] = None
        except ValueError as err:
            found[name] = str(err)
    return found


def cases():
    """GVA (HV = 2H) with K != V and one value head per key head in sbhd; packed thd with and
    without padding tails: at the launch's CP size (CP key heads: one per rank)."""
    cp = dist.get_world_size(_cp_group())
    hk = cp
    return [
        check(hk, 2 * hk, 8, 6, seq=8 * cp),
        check(2 * hk, 2 * hk, 8, 8, seq=4 * cp, batch=1),
        check(hk, 2 * hk, 8, 6, layout="thd", padded=(4 * cp, 6 * cp, 2 * cp)),
        check(hk, 2 * hk, 4, 6, layout="thd", padded=(4 * cp, 8 * cp), real=(4 * cp - 1, 5 * cp)),
    ]


def check_layer(layout: str, padded=None, recompute=False):
    """The real ``NPUGatedDeltaNet`` (the hybrid spec's GDN layer, H=CP, HV=2CP key/value
    heads) on this rank's chunks against a copy of it whose CP seam is
    ``NoContextParallel`` (the one-process layer) on the whole sequence: output, input
    gradient and every parameter gradient (summed over CP). Both are built from one seed."""
    from mcore_npu.transformer.gated_delta_net import NoContextParallel
    from tests.transformer.gdn_models import gdn_config, gdn_layer

    group = _cp_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    extra = (
        dict(recompute_granularity="selective", recompute_modules=["core_attn"])
        if recompute
        else {}
    )
    config = gdn_config(
        context_parallel_size=size,
        linear_num_key_heads=size,
        linear_num_value_heads=2 * size,
        init_method_std=0.3,  # outputs of order 1 (0.02 leaves them near 1e-3)
        **extra,
    )
    layer, one = gdn_layer(config, seed=0), gdn_layer(config, seed=0)  # the same weights
    for mine, theirs in zip(layer.parameters(), one.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    one.context_parallel = NoContextParallel()  # an instance of ours: the seam at CP = 1
    assert type(layer.context_parallel).__name__ == "GDNContextParallel"
    gen = torch.Generator().manual_seed(3)
    packed = layout == "thd"
    total = sum(padded) if packed else 8 * size
    x = torch.randn(total, 1 if packed else 2, config.hidden_size, generator=gen)
    dy = torch.randn(x.shape, generator=gen)
    params = _packed_params(padded) if packed else None
    cu = params.cu_seqlens_q_padded.long() if packed else None
    index = (thd_get_partitioned_indices(cu, total, size, rank) if packed
             else _zigzag_index(total))  # fmt: skip

    x_one = x.clone().requires_grad_()
    y_one, _ = one(x_one, None, packed_seq_params=params)
    y_one.backward(dy)
    x_mine = x.index_select(0, index).clone().requires_grad_()
    y_mine, _ = layer(x_mine, None, packed_seq_params=params)
    y_mine.backward(dy.index_select(0, index))
    grads = {name: p.grad for name, p in layer.named_parameters()}
    for grad in grads.values():
        dist.all_reduce(grad, group=group)
    want = {"out": y_one.detach().index_select(0, index), "dx": x_one.grad.index_select(0, index),
            **{f"d{n}": p.grad for n, p in one.named_parameters()}}  # fmt: skip
    got = {"out": y_mine.detach(), "dx": x_mine.grad, **{f"d{n}": g for n, g in grads.items()}}
    errors = torch.tensor([[(got[n] - want[n]).abs().max(), want[n].abs().max()] for n in want])
    dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=group)
    return {"module": "NPUGatedDeltaNet", "layout": layout, "cp": size, "padded": padded,
            "recompute": recompute, "max_abs_error": dict(zip(want, errors[:, 0].tolist())),
            "max_abs_value": dict(zip(want, errors[:, 1].tolist()))}  # fmt: skip


def _packed_params(padded):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                           max_seqlen_q=max(padded), max_seqlen_kv=max(padded))  # fmt: skip


def layer_cases():
    """The layer in sbhd, packed thd, and with selective recompute of its core."""
    cp = dist.get_world_size(_cp_group())
    return [check_layer("sbhd"), check_layer("thd", padded=(4 * cp, 2 * cp, 6 * cp)),
            check_layer("sbhd", recompute=True)]  # fmt: skip


def main() -> None:
    rt = runtime.initialize(runtime.ParallelLayout(context=dist_size()), seed=0)
    results, found = cases() + layer_cases(), refusals()
    if rt.launch.rank == 0:
        for result in results:
            print("GDN_CASE " + json.dumps(result), flush=True)
        print("GDN_REFUSALS " + json.dumps(found), flush=True)
    runtime.shutdown()


def dist_size() -> int:
    """The launch's world size (torchrun's ``WORLD_SIZE``), before any process group."""
    return runtime.LaunchEnv.from_environ().world_size


if __name__ == "__main__":
    main()
