"""Run under ``torchrun --nproc-per-node 2``: NPUFusionAttention with CP=2 against CP=1.

Every rank computes the one-process answer itself (the same module without context
parallelism, on the whole sequence: no collective involved), then the CP=2 module on its own
chunks, as Megatron's ``get_batch_on_this_cp_rank`` cuts them. It compares the output and
dQ/dK/dV of its chunks, and rank 0 prints one JSON line per case (``CASE {...}``).

The stand-in ``torch_npu`` case (no NPU here) puts a module into ``sys.modules`` whose
``npu_fusion_attention`` / ``npu_fusion_attention_grad`` run the reference and record their
arguments, so the ring is seen calling the real operators' API.
"""

from __future__ import annotations

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

SEQ, BATCH, HEAD_DIM = 16, 2, 8


def _config(heads, groups, cp, comm):
    return TransformerConfig(
        num_layers=1, hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=HEAD_DIM, attention_dropout=0.0,
        context_parallel_size=cp, cp_comm_type=comm if cp > 1 else None,
        use_cpu_initialization=True,
    )  # fmt: skip


def _local(t):
    """``[s, b, ...]`` -> this CP rank's chunks ``[s/CP, b, ...]`` (Megatron's own split)."""
    return get_batch_on_this_cp_rank({"x": t.transpose(0, 1)})["x"].transpose(0, 1).contiguous()


def _run(module, q, k, v, dy, mask_type):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = module(*leaves, None, attn_mask_type=mask_type)
    out.backward(dy)
    return [out.detach(), *(t.grad for t in leaves)]


def check(comm, heads, groups, mask_type, kernel="reference"):
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=gen)
    k, v = (torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=gen) for _ in range(2))
    dy = torch.randn(SEQ, BATCH, heads * HEAD_DIM, generator=gen)
    single = NPUFusionAttention(_config(heads, groups, 1, None), 1, mask_type,
                                kernel="reference")  # fmt: skip
    want = [_local(t) for t in _run(single, q, k, v, dy, mask_type)]
    parallel = NPUFusionAttention(_config(heads, groups, 2, comm), 1, mask_type, kernel=kernel)
    got = _run(parallel, *(_local(t) for t in (q, k, v, dy)), mask_type)
    errors = {
        name: (g - w).abs().max().item() for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)
    }
    return {"comm": comm, "heads": heads, "groups": groups, "mask": mask_type.name,
            "kernel": kernel, "max_abs_error": errors}  # fmt: skip


class RecordingTorchNpu(types.ModuleType):
    """Stand-in torch_npu (no NPU here): the reference kernels, recording every call."""

    def __init__(self):
        super().__init__("torch_npu")
        self.forward_calls, self.grad_calls = [], []

    def npu_fusion_attention(self, *args, **kwargs):
        self.forward_calls.append(_describe(args, kwargs))
        return reference.npu_fusion_attention(*args, **kwargs)

    def npu_fusion_attention_grad(self, *args, **kwargs):
        self.grad_calls.append(_describe(args, kwargs))
        return reference.npu_fusion_attention_grad(*args, **kwargs)


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


def _errors(got, want):
    """Worst absolute error of out, dQ, dK, dV over both ranks (their blocks differ)."""
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


def check_packed(comm, heads, groups, *, causal=True, window=None, kernel="reference"):
    """thd: 2 ranks (``thd_ends`` = local padded ends) against one TND call on the whole pack."""
    from mcore_npu.ops import fusion_attention
    from mcore_npu.transformer.context_parallel import ring, ulysses
    from mcore_npu.transformer.context_parallel.thd import thd_get_partitioned_indices

    group = _cp_group()
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    cu = torch.tensor((0, *PACKED_LENGTHS)).cumsum(0)
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
            "kernel": kernel, "max_abs_error": _errors(got, want)}  # fmt: skip


def check_window(comm, heads, groups, window):
    """sbhd sliding window: 2 ranks (Megatron's chunks) against one SBH call."""
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
        results.append(check_window("p2p", 4, 2, window))
    results.append(check_window("a2a", 4, 2, WINDOWS[0]))
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


def main():
    rt = runtime.initialize(runtime.ParallelLayout(context=2), seed=0)
    results = []
    for comm in ("p2p", "all_gather", "a2a"):
        for heads, groups in ((4, 4), (4, 2)):
            results.append(check(comm, heads, groups, AttnMaskType.causal))
        if comm != "p2p":
            results.append(check(comm, 4, 2, AttnMaskType.no_mask))
    stand_in = RecordingTorchNpu()
    sys.modules["torch_npu"] = stand_in
    try:
        results.append(check("p2p", 4, 2, AttnMaskType.causal, kernel="torch_npu"))
    finally:
        del sys.modules["torch_npu"]
    packed_results, packed_calls, packed_refusals = packed_and_window_cases()
    results += packed_results
    if rt.launch.rank == 0:
        for result in results:
            print("CASE " + json.dumps(result), flush=True)
        print("STANDIN " + json.dumps({"forward": stand_in.forward_calls,
                                       "grad": stand_in.grad_calls}), flush=True)  # fmt: skip
        print("REFUSALS " + json.dumps(refusals()), flush=True)
        print("STANDIN_THD " + json.dumps(packed_calls), flush=True)
        print("REFUSALS_THD " + json.dumps(packed_refusals), flush=True)
    runtime.shutdown()


if __name__ == "__main__":
    main()
