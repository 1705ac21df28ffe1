"""Run under ``torchrun --nproc-per-node 2``: NPUFusionAttention with CP=2 against CP=1
(``--cp 4`` under ``--nproc-per-node 4``: the CP=4 cases of :func:`main_cp4`).

Every rank computes the one-process answer itself (the same module without context
parallelism, on the whole sequence: no collective involved), then the CP module on its own
chunks, as Megatron's ``get_batch_on_this_cp_rank`` cuts them. It compares the output and
dQ/dK/dV of its chunks, the worst error over the ranks is taken, and rank 0 prints one JSON
line per case (``CASE {...}``).

The stand-in ``torch_npu`` case (no NPU here) puts a module into ``sys.modules`` whose
``npu_fusion_attention`` / ``npu_fusion_attention_grad`` run the reference and record their
arguments, so the ring is seen calling the real operators' API.
"""

from __future__ import annotations

import contextlib
import json
import sys
import types

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank

from mcore_npu.ops import reference
from mcore_npu.training import runtime
from mcore_npu.transformer.attention import NPUFusionAttention
from mcore_npu.transformer.context_parallel import thd_get_partitioned_indices
from tests.distributed import batch_invariant_tp, cp_rope, gdn_cp, mla_parallel

SEQ, BATCH, HEAD_DIM = 16, 2, 8


def _config(heads, groups, cp, comm, window=None):
    return TransformerConfig(
        num_layers=1, hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=HEAD_DIM, attention_dropout=0.0,
        context_parallel_size=cp, cp_comm_type=comm if cp > 1 else None,
        use_cpu_initialization=True, window_size=window,
    )  # fmt: skip


def _local(t):
    """``[s, b, ...]`` -> this CP rank's chunks ``[s/CP, b, ...]`` (Megatron's own split)."""
    return get_batch_on_this_cp_rank({"x": t.transpose(0, 1)})["x"].transpose(0, 1).contiguous()


def _run(module, q, k, v, dy, mask_type):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = module(*leaves, None, attn_mask_type=mask_type)
    out.backward(dy)
    return [out.detach(), *(t.grad for t in leaves)]


def check(comm, heads, groups, mask_type, kernel="reference", cp=2):
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=gen)
    k, v = (torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=gen) for _ in range(2))
    dy = torch.randn(SEQ, BATCH, heads * HEAD_DIM, generator=gen)
    single = NPUFusionAttention(_config(heads, groups, 1, None), 1, mask_type,
                                kernel="reference")  # fmt: skip
    want = [_local(t) for t in _run(single, q, k, v, dy, mask_type)]
    parallel = NPUFusionAttention(_config(heads, groups, cp, comm), 1, mask_type, kernel=kernel)
    got = _run(parallel, *(_local(t) for t in (q, k, v, dy)), mask_type)
    errors = _errors(got, want)
    return {"comm": comm, "heads": heads, "groups": groups, "mask": mask_type.name,
            "kernel": kernel, "cp": cp, "max_abs_error": errors}  # fmt: skip


class RecordingTorchNpu(types.ModuleType):
    """Stand-in torch_npu (no NPU here): the reference kernels, recording every call."""

    def __init__(self):
        super().__init__("torch_npu")
        self.forward_calls, self.grad_calls = [], []
        self.events = []  # "forward" / "grad" / "transfer", in the order they were issued

    def npu_fusion_attention(self, *args, **kwargs):
        self.forward_calls.append(_describe(args, kwargs))
        self.events.append("forward")
        return reference.npu_fusion_attention(*args, **kwargs)

    def npu_fusion_attention_grad(self, *args, **kwargs):
        self.grad_calls.append(_describe(args, kwargs))
        self.events.append("grad")
        return reference.npu_fusion_attention_grad(*args, **kwargs)


@contextlib.contextmanager
def transfers_recorded(stand_in: RecordingTorchNpu):
    """Log each batch of point-to-point messages (the real ``batch_isend_irecv``, which still
    sends) into the stand-in's ``events``, to see when the ring issues its transfers."""
    real = torch.distributed.batch_isend_irecv

    def recorded(ops):
        stand_in.events.append("transfer")
        return real(ops)

    torch.distributed.batch_isend_irecv = recorded
    try:
        yield
    finally:
        torch.distributed.batch_isend_irecv = real


def _describe(args, kwargs):
    shapes = [list(a.shape) for a in args if isinstance(a, torch.Tensor)]
    plain = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    tensors = {k: list(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    layout = [a for a in args if isinstance(a, str)]
    return {"shapes": shapes, "layout": layout, "kwargs": plain, "tensor_kwargs": tensors}


def refusals():
    found = {}
    for name, build in {
        "a2a_mqa": lambda: NPUFusionAttention(_config(4, 1, 2, "a2a"), 1, AttnMaskType.causal),
        "a2a+p2p": lambda: NPUFusionAttention(_config(4, 4, 2, "a2a+p2p"), 1, AttnMaskType.causal),
    }.items():
        try:
            build()
            found[name] = None
        except (ValueError, NotImplementedError) as err:
            found[name] = str(err)
    module = NPUFusionAttention(_config(4, 4, 2, "all_gather"), 1, AttnMaskType.causal)
    x = torch.randn(SEQ // 2, BATCH, 4, HEAD_DIM)
    for name, kwargs in {
        "attention_bias": dict(attention_mask=None, attention_bias=torch.zeros(1, 4, 8, 8)),
        "dense_mask": dict(attention_mask=torch.zeros(BATCH, 1, 8, 8, dtype=torch.bool),
                           attn_mask_type=AttnMaskType.padding),
    }.items():  # fmt: skip
        try:
            module(x, x, x, **kwargs)
            found[name] = None
        except NotImplementedError as err:
            found[name] = str(err)
    return found


# --- packed (thd) and sliding-window cases of the ring and Ulysses (ring.attention and
# ulysses.attention called directly, without the module's dispatch) --------------------------

PACKED_LENGTHS = (8, 12, 4, 16)  # padded, each a multiple of 2 * CP = 4; T = 40
WINDOWS = ((5, 0), (9, 0))  # chunk = 4 at SEQ = 16: ring blocks skipped, full and banded


def _cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def _grads(fn, q, k, v, dy):
    """Output and dQ/dK/dV of ``fn(q, k, v)`` (autograd from leaf copies)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dy)
    return [out.detach(), *(t.grad for t in leaves)]


# -- packed (thd) sequences and sliding windows (helper 13a: all_gather) ----------------------

PADDED = (8, 16, 4, 12)  # every padded length divides by 2 * CP = 4
REAL = (8, 13, 3, 12)  # two sequences with a padding tail


def _packed_params(real, padded):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_real = torch.tensor([0, *torch.tensor(real).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real,
        cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(padded), max_seqlen_kv=max(padded),
    )  # fmt: skip


def _real_positions(real, padded):
    """``[T]`` bool: True at real tokens, False at each sequence's padding tail."""
    return torch.cat([torch.arange(p) < r for r, p in zip(real, padded)])


def check_thd(comm, heads, groups, mask_type, window=None, real=REAL, kernel="reference", *,
              cp=2, padded=PADDED):  # fmt: skip
    """Packed batch on ``cp`` ranks (Megatron's thd split) against one process, same params.

    The upstream gradient is 0 at padding positions (their loss is masked), so padding tokens
    never reach a real one: out is compared at real tokens, dQ/dK/dV everywhere.
    """
    gen = torch.Generator().manual_seed(5)
    total = sum(padded)
    q = torch.randn(total, heads, HEAD_DIM, generator=gen)
    k, v = (torch.randn(total, groups, HEAD_DIM, generator=gen) for _ in range(2))
    keep = _real_positions(real, padded)
    dy = torch.randn(total, heads * HEAD_DIM, generator=gen) * keep[:, None]
    params = _packed_params(real, padded)
    single = NPUFusionAttention(_config(heads, groups, 1, None, window), 1, mask_type,
                                kernel="reference")  # fmt: skip
    rank = torch.distributed.get_rank()
    index = thd_get_partitioned_indices(params.cu_seqlens_q_padded, total, cp, rank)
    want = [t.index_select(0, index) for t in _run_thd(single, q, k, v, dy, mask_type, params)]
    parallel = NPUFusionAttention(_config(heads, groups, cp, comm, window), 1, mask_type,
                                  kernel=kernel)  # fmt: skip
    local = [t.index_select(0, index) for t in (q, k, v, dy)]
    got = _run_thd(parallel, *local, mask_type, params)
    real_rows = keep.index_select(0, index)
    got[0], want[0] = got[0][real_rows], want[0][real_rows]
    errors = _errors(got, want)
    return {"comm": comm, "heads": heads, "groups": groups, "mask": mask_type.name,
            "kernel": kernel, "layout": "thd", "window": window, "cp": cp,
            "padded": real != padded, "max_abs_error": errors}  # fmt: skip


def _run_thd(module, q, k, v, dy, mask_type, params):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = module(*leaves, None, attn_mask_type=mask_type, packed_seq_params=params)
    out.backward(dy)
    return [out.detach(), *(t.grad for t in leaves)]


def _errors(got, want):
    """Worst absolute error of out, dQ, dK, dV over the CP ranks (their blocks differ)."""
    names = ("out", "dq", "dk", "dv")
    worst = torch.stack([(g - w).abs().max() for g, w in zip(got, want)])
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX, group=_cp_group())
    return dict(zip(names, worst.tolist()))


def _one_process_kwargs(causal, window, ends, layout_kind):
    """The whole-sequence operator's mask keywords (the answer the CP run must reproduce)."""
    from mcore_npu.masks import BottomRightCausalMask, FullAttention, SlidingWindow

    within = SlidingWindow(*window) if window else (BottomRightCausalMask() if causal
                                                     else FullAttention())  # fmt: skip
    kwargs = within.operator_args().as_kwargs()
    if layout_kind == "thd":
        kwargs.update(actual_seq_qlen=list(ends), actual_seq_kvlen=list(ends))
    return kwargs


def check_packed(comm, heads, groups, *, causal=True, window=None, kernel="reference",
                 lengths=PACKED_LENGTHS):  # fmt: skip
    """thd: the CP ranks (``thd_ends`` = local padded ends) against one TND call on the whole
    pack of padded ``lengths``."""
    from mcore_npu.ops import fusion_attention
    from mcore_npu.transformer.context_parallel import ring, ulysses
    from mcore_npu.transformer.context_parallel.thd import thd_get_partitioned_indices

    group = _cp_group()
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    cu = torch.tensor((0, *lengths)).cumsum(0)
    total = int(cu[-1])
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(total, heads, HEAD_DIM, generator=gen)
    k, v = (torch.randn(total, groups, HEAD_DIM, generator=gen) for _ in range(2))
    dy = torch.randn(total, heads * HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    op = _one_process_kwargs(causal, window, cu[1:].tolist(), "thd")

    def whole(q, k, v):
        return fusion_attention(q, k, v, heads, "TND", kernel="reference", scale=scale,
                                **op).flatten(1)  # fmt: skip

    mine = thd_get_partitioned_indices(cu, total, size, rank)
    want = [t[mine] for t in _grads(whole, q, k, v, dy)]
    ends = tuple(int(e) for e in (cu[1:] // size))
    algorithm = {"p2p": ring, "a2a": ulysses}[comm]

    def parallel(q, k, v):
        return algorithm.attention(q, k, v, group, heads=heads, scale=scale, causal=causal,
                                   kernel=kernel, thd_ends=ends, window=window)  # fmt: skip

    got = _grads(parallel, *(t[mine] for t in (q, k, v, dy)))
    mask = f"window{window}" if window else ("causal" if causal else "no_mask")
    return {"comm": comm, "format": "thd", "heads": heads, "groups": groups, "mask": mask,
            "kernel": kernel, "cp": size, "max_abs_error": _errors(got, want)}  # fmt: skip


def check_window_direct(comm, heads, groups, window):
    """sbhd sliding window through ``ring`` / ``ulysses`` directly: 2 ranks (Megatron's
    chunks) against one SBH call."""
    from mcore_npu.ops import fusion_attention
    from mcore_npu.transformer.context_parallel import ring, ulysses

    group = _cp_group()
    gen = torch.Generator().manual_seed(17)
    q = torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=gen)
    k, v = (torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=gen) for _ in range(2))
    dy = torch.randn(SEQ, BATCH, heads * HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    op = _one_process_kwargs(True, window, None, "sbhd")

    def whole(q, k, v):
        return fusion_attention(q.flatten(2), k.flatten(2), v.flatten(2), heads, "SBH",
                                kernel="reference", scale=scale, **op)  # fmt: skip

    want = [_local(t) for t in _grads(whole, q, k, v, dy)]
    algorithm = {"p2p": ring, "a2a": ulysses}[comm]

    def parallel(q, k, v):
        return algorithm.attention(q, k, v, group, heads=heads, scale=scale, causal=True,
                                   kernel="reference", window=window)  # fmt: skip

    got = _grads(parallel, *(_local(t) for t in (q, k, v, dy)))
    return {"comm": comm, "format": "sbhd", "heads": heads, "groups": groups,
            "mask": f"window{window}", "kernel": "reference",
            "cp": torch.distributed.get_world_size(group),
            "max_abs_error": _errors(got, want)}  # fmt: skip


def packed_and_window_cases():
    """13b's cases: thd for p2p and a2a (MHA, GQA), windows for a2a (sbhd, thd) and p2p
    (sbhd), the thd ring through the stand-in torch_npu, and the refused p2p thd window."""
    results = []
    for comm in ("p2p", "a2a"):
        for heads, groups in ((4, 4), (4, 2)):
            results.append(check_packed(comm, heads, groups))
    results.append(check_packed("a2a", 4, 2, causal=False))
    results.append(check_packed("a2a", 4, 2, window=WINDOWS[0]))
    for window in WINDOWS:
        results.append(check_window_direct("p2p", 4, 2, window))
    results.append(check_window_direct("a2a", 4, 2, WINDOWS[0]))
    stand_in = RecordingTorchNpu()
    sys.modules["torch_npu"] = stand_in
    try:
        results.append(check_packed("p2p", 4, 2, kernel="torch_npu"))
    finally:
        del sys.modules["torch_npu"]
    try:
        check_packed("p2p", 4, 2, window=WINDOWS[0])
        refused = None
    except NotImplementedError as err:
        refused = str(err)
    calls = {"forward": stand_in.forward_calls, "grad": stand_in.grad_calls}
    return results, calls, {"p2p_thd_window": refused}


def check_window(comm, heads, groups, mask_type, window):
    """sbhd with a sliding window on 2 ranks against one process."""
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=gen)
    k, v = (torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=gen) for _ in range(2))
    dy = torch.randn(SEQ, BATCH, heads * HEAD_DIM, generator=gen)
    single = NPUFusionAttention(_config(heads, groups, 1, None, window), 1, mask_type,
                                kernel="reference")  # fmt: skip
    want = [_local(t) for t in _run(single, q, k, v, dy, mask_type)]
    parallel = NPUFusionAttention(_config(heads, groups, 2, comm, window), 1, mask_type)
    got = _run(parallel, *(_local(t) for t in (q, k, v, dy)), mask_type)
    errors = _errors(got, want)
    return {"comm": comm, "heads": heads, "groups": groups, "mask": mask_type.name,
            "kernel": "reference", "layout": "sbhd", "window": window,
            "max_abs_error": errors}  # fmt: skip


def module_thd_and_window_cases():
    """Through ``NPUFusionAttention``'s dispatch: all_gather thd (causal MHA/GQA with padded
    sequences, full, causal window) and sbhd windows; p2p and a2a thd and sbhd windows."""
    causal, full = AttnMaskType.causal, AttnMaskType.no_mask
    results = [check_thd("all_gather", 4, groups, causal) for groups in (4, 2)]
    results.append(check_thd("all_gather", 4, 2, full, real=PADDED))
    results.append(check_thd("all_gather", 4, 2, causal, window=(3, 0)))
    results.append(check_window("all_gather", 4, 2, causal, (5, 0)))
    results.append(check_window("all_gather", 4, 4, full, (3, 2)))
    results.append(check_window("all_gather", 4, 2, full, (-1, 6)))
    for comm in ("p2p", "a2a"):  # the same module dispatch into the ring and Ulysses
        results.append(check_thd(comm, 4, 2, causal))
        results.append(check_window(comm, 4, 2, causal, (5, 0)))
    results.append(check_thd("a2a", 4, 2, causal, window=(3, 0)))
    return results


def thd_refusals():
    """What packed CP refuses: non-causal attention over padded sequences, bad padding."""
    found = {}
    module = NPUFusionAttention(_config(4, 4, 2, "all_gather"), 1, AttnMaskType.no_mask)
    x = torch.randn(sum(PADDED) // 2, 4, HEAD_DIM)
    bad = _packed_params((6, 16, 4, 12), (6, 16, 4, 14))
    for name, params in {"full_padded": _packed_params(REAL, PADDED), "odd": bad}.items():
        try:
            module(x, x, x, None, packed_seq_params=params)
            found[name] = None
        except (ValueError, NotImplementedError) as err:
            found[name] = str(err)
    return found


def memo_conversions():
    """Three layers sharing one memo, one step: cu_seqlens reach the host once per tensor
    (real and padded: 2), not once per layer; told in advance (the trainer): no sync at all."""
    from mcore_npu.masks import SeqLengthsMemo

    found = {}
    for told in (False, True):
        memo = SeqLengthsMemo()
        params = _packed_params(REAL, PADDED)
        if told:
            for cu in (params.cu_seqlens_q, params.cu_seqlens_q_padded):
                memo.remember(cu, tuple(cu[1:].tolist()))
        layers = [NPUFusionAttention(_config(4, 2, 2, "all_gather"), n, AttnMaskType.causal,
                                     seq_lengths_memo=memo) for n in (1, 2, 3)]  # fmt: skip
        q = torch.randn(sum(PADDED) // 2, 4, HEAD_DIM)
        kv = torch.randn(sum(PADDED) // 2, 2, HEAD_DIM)
        for layer in layers:
            layer(q, kv, kv, None, packed_seq_params=params)
        found["told" if told else "converted"] = memo.conversions
    return found


def main():
    rt = runtime.initialize(runtime.ParallelLayout(context=2), seed=0)
    results = []
    for comm in ("p2p", "all_gather", "a2a"):
        for heads, groups in ((4, 4), (4, 2)):
            results.append(check(comm, heads, groups, AttnMaskType.causal))
        if comm != "p2p":
            results.append(check(comm, 4, 2, AttnMaskType.no_mask))
    results.extend(module_thd_and_window_cases())
    memo = memo_conversions()  # collectives: every rank runs it
    rope = (
        cp_rope.cases()
    )  # fused RoPE against Megatron's under CP=2 (tests/distributed/cp_rope.py)
    stand_in = RecordingTorchNpu()
    sys.modules["torch_npu"] = stand_in
    try:
        with transfers_recorded(stand_in):
            results.append(check("p2p", 4, 2, AttnMaskType.causal, kernel="torch_npu"))
    finally:
        del sys.modules["torch_npu"]
    packed_results, packed_calls, packed_refusals = packed_and_window_cases()
    results += packed_results

    thd_stand_in = RecordingTorchNpu()  # the packed all_gather path: how many operator calls
    sys.modules["torch_npu"] = thd_stand_in
    try:
        results.append(check_thd("all_gather", 4, 2, AttnMaskType.causal, kernel="torch_npu"))
    finally:
        del sys.modules["torch_npu"]
    mla = mla_parallel.cases()  # an MLA GPT: CP=2 and TP=2 against one process (own layouts)
    invariant = batch_invariant_tp.cases()  # batch-invariant mode at TP=2 (own layouts)
    gdn = gdn_cp.cases() + gdn_cp.layer_cases()  # Gated DeltaNet's all-to-all
    gdn_refused = gdn_cp.refusals()
    if rt.launch.rank == 0:
        for result in results:
            print("CASE " + json.dumps(result), flush=True)
        print("STANDIN " + json.dumps({"forward": stand_in.forward_calls,
                                       "grad": stand_in.grad_calls,
                                       "events": stand_in.events}), flush=True)  # fmt: skip
        print("REFUSALS " + json.dumps(refusals()), flush=True)
        print("STANDIN_THD " + json.dumps(packed_calls), flush=True)
        print("REFUSALS_THD " + json.dumps(packed_refusals), flush=True)

        print("THD_REFUSALS " + json.dumps(thd_refusals()), flush=True)
        print("MEMO " + json.dumps(memo), flush=True)
        for result in rope:
            print("ROPE " + json.dumps(result), flush=True)
        for result in mla:
            print("MLA " + json.dumps(result), flush=True)
        for result in invariant:
            print("BATCH_INVARIANT " + json.dumps(result), flush=True)
        for result in gdn:
            print("GDN_CASE " + json.dumps(result), flush=True)
        print("GDN_REFUSALS " + json.dumps(gdn_refused), flush=True)
        print("STANDIN_THD_GATHER " + json.dumps({"padded": PADDED, "forward": thd_stand_in.forward_calls}),
              flush=True)  # fmt: skip
    runtime.shutdown()


PACKED_LENGTHS_CP4 = (8, 16, 8, 24)  # each a multiple of 2 * CP = 8
REAL_CP4 = (8, 13, 3, 24)


def main_cp4():
    """CP=4 on 4 ranks: ring steps with three earlier or later ranks and dK/dV home after
    three hops, the all-gather's natural order of four ranks' chunks, Ulysses over four head
    groups; sbhd (chunks of 2 tokens, so windows span several chunks) and packed thd."""
    rt = runtime.initialize(runtime.ParallelLayout(context=4), seed=0)
    causal, full = AttnMaskType.causal, AttnMaskType.no_mask
    results = []
    for comm in ("p2p", "all_gather", "a2a"):
        for heads, groups in ((4, 4), (8, 4)):
            results.append(check(comm, heads, groups, causal, cp=4))
        if comm != "p2p":
            results.append(check(comm, 8, 4, full, cp=4))
    for window in WINDOWS:
        results.append(check_window_direct("p2p", 8, 4, window))
    results.append(check_window_direct("a2a", 8, 4, WINDOWS[0]))
    for comm in ("p2p", "a2a"):
        results.append(check_packed(comm, 8, 4, lengths=PACKED_LENGTHS_CP4))
    results.append(check_thd("all_gather", 8, 4, causal, real=REAL_CP4, cp=4,
                             padded=PACKED_LENGTHS_CP4))  # fmt: skip
    gdn = gdn_cp.cases() + gdn_cp.layer_cases()  # Gated DeltaNet over four head groups
    if rt.launch.rank == 0:
        for result in results:
            print("CASE " + json.dumps(result), flush=True)
        for result in gdn:
            print("GDN_CASE " + json.dumps(result), flush=True)
    runtime.shutdown()


if __name__ == "__main__":
    main_cp4() if sys.argv[1:] == ["--cp", "4"] else main()
