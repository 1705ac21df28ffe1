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
    if rt.launch.rank == 0:
        for result in results:
            print("CASE " + json.dumps(result), flush=True)
        print("STANDIN " + json.dumps({"forward": stand_in.forward_calls,
                                       "grad": stand_in.grad_calls}), flush=True)  # fmt: skip
        print("REFUSALS " + json.dumps(refusals()), flush=True)
    runtime.shutdown()


if __name__ == "__main__":
    main()
