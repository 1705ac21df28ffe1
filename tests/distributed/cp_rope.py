"""Fused RoPE under context parallelism (run inside a CP=2 torchrun launch: ``cp_attention.py``
calls :func:`cases`; alone: ``torchrun --nproc-per-node 2 tests/distributed/cp_rope.py``).

For each CP algorithm (p2p, all_gather, a2a) and each format (sbhd, packed thd with padded
sequences), a tiny GPT with the NPU spec and ``rope_kernel="reference"`` runs on this rank's
chunks against the same model (same weights) with Megatron's own RoPE (``rope_kernel="off"``):
logits and every parameter gradient, the worst error over the ranks. Rank 0 prints the results.
"""

from __future__ import annotations

import json

import torch

VOCAB, SEQ, BATCH = 96, 16, 2
PADDED = (8, 16, 4, 12)  # every padded length divides by 2 * CP = 4
REAL = (8, 13, 3, 12)


def _config(comm, interleaved=False):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=F.silu, qk_layernorm=True, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, bias_activation_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        context_parallel_size=2, cp_comm_type=comm, rotary_interleaved=interleaved,
    )  # fmt: skip


def _model(config, rope_kernel):
    from megatron.core.models.gpt import GPTModel

    from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec

    spec = get_gpt_layer_npu_spec(
        normalization="RMSNorm", qk_layernorm=True, kernel="reference", param_layout="local",
        rms_norm_kernel="reference", swiglu_kernel="reference", rope_kernel=rope_kernel,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=64, position_embedding_type="rope")  # fmt: skip


def _run(model, ids, pos, **kwargs):
    model.zero_grad(set_to_none=True)
    logits = model(ids, pos, None, **kwargs)
    upstream = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
    (logits * upstream).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _sbhd_inputs():
    from megatron.core.utils import get_batch_on_this_cp_rank

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    pos = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    local = get_batch_on_this_cp_rank({"tokens": ids, "position_ids": pos})
    return (local["tokens"], local["position_ids"]), {}


def _thd_inputs():
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcore_npu.transformer.context_parallel import thd_get_partitioned_indices

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu(REAL), cu_seqlens_kv=cu(REAL),
        cu_seqlens_q_padded=cu(PADDED), cu_seqlens_kv_padded=cu(PADDED),
        max_seqlen_q=max(PADDED), max_seqlen_kv=max(PADDED),
    )  # fmt: skip
    total = sum(PADDED)
    ids = torch.randint(0, VOCAB, (1, total), generator=torch.Generator().manual_seed(4))
    pos = torch.cat([torch.arange(n) for n in PADDED])[None]
    index = thd_get_partitioned_indices(params.cu_seqlens_q_padded, total, 2, _rank())
    return (ids[:, index], pos[:, index]), {"packed_seq_params": params}


def _rank():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_rank()


def check(comm, layout, interleaved=False):
    """Fused against unfused RoPE under CP=2: worst |logit| and |grad| error over the ranks."""
    from megatron.core import parallel_state

    config = _config(comm, interleaved)
    unfused, fused = _model(config, "off"), _model(config, "reference")
    fused.load_state_dict(unfused.state_dict(), strict=True)
    (ids, pos), kwargs = _sbhd_inputs() if layout == "sbhd" else _thd_inputs()
    want, want_grads = _run(unfused, ids, pos, **kwargs)
    cache = fused.decoder.layers[0].self_attention.rope_cache
    got, got_grads = _run(fused, ids, pos, **kwargs)
    worst = torch.tensor([
        (got - want).abs().max().item(),
        max((got_grads[n] - want_grads[n]).abs().max().item() for n in want_grads),
        float(got_grads.keys() != want_grads.keys()),
    ], dtype=torch.float64)  # fmt: skip
    group = parallel_state.get_context_parallel_group()
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX, group=group)
    return {"comm": comm, "layout": layout, "interleaved": interleaved,
            "tokens_per_rank": int(ids.shape[1]), "cos_sin_builds": cache.builds,
            "logits": worst[0].item(), "grads": worst[1].item(),
            "grad_names_differ": bool(worst[2].item())}  # fmt: skip


def cases():
    """Every case (collectives: every CP rank runs this)."""
    results = []
    for comm in ("p2p", "all_gather", "a2a"):
        for layout in ("sbhd", "thd"):
            results.append(check(comm, layout))
    results.append(check("p2p", "thd", interleaved=True))
    return results


def main():
    from mcore_npu.training import runtime

    rt = runtime.initialize(runtime.ParallelLayout(context=2), seed=0)
    results = cases()
    if rt.launch.rank == 0:
        for result in results:
            print("ROPE " + json.dumps(result), flush=True)
    runtime.shutdown()


if __name__ == "__main__":
    main()
