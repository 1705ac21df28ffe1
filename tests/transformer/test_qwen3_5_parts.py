"""Qwen3.5's attention and MoE pieces in the NPU spec, against Megatron-Core 0.16.1's meaning.

- Zero-centred norms (``layernorm_zero_centered_gamma``): Megatron's local norms refuse them
  (``WrappedTorchNorm``); TE's multiply by ``1 + weight``. So a zero-centred model with norm
  weights ``w`` must equal the same model without the flag and with norm weights ``1 + w``:
  logits and every gradient, in both parameter layouts, the fused ``npu_rms_norm`` (reference)
  and the torch paths, RMSNorm and LayerNorm.
- The gated attention output (``attention_output_gate``) with partial RoPE
  (``rotary_percent=0.25``): the NPU spec (``NPUSelfAttention``, ``NPURotarySelfAttention`` with
  fused RoPE) against Megatron's local spec. Megatron's ``_apply_output_gate`` is
  ``torch.compile``'d (its ``jit_fuser``; 70 s to compile on this CPU), so the local twin runs
  the same Megatron function uncompiled (``_torchdynamo_orig_callable``): the numbers are
  Megatron's code, only not compiled. Packed thd: every sequence's logits equal it alone.
- The MoE shared-expert gate with Qwen3.5's router (softmax, top-k renormalised): against
  Megatron's local MoE layer (SequentialMLP).
All fp32 on the CPU (reference kernels).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.megatron_features import needs_fields
from tests.transformer.megatron_models import VOCAB, batch, gpt, tiny_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

TOLERANCE = 1e-5
NORM_WEIGHT = re.compile(r"(layernorm\.weight|layer_norm_weight)$")


def _npu_spec(config, param_layout="local", rms_norm_kernel="reference", rope_kernel="off"):
    """The NPU decoder-block spec (its final norm is the spec's too)."""
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    return get_gpt_decoder_block_npu_spec(
        config, normalization=config.normalization, kernel="reference",
        param_layout=param_layout, rms_norm_kernel=rms_norm_kernel, swiglu_kernel="reference",
        grouped_matmul_kernel="reference", rope_kernel=rope_kernel,
    )  # fmt: skip


def _partial_rope_gpt(config, spec):
    """A GPTModel whose RoPE turns the first quarter of each head (Qwen3.5's
    ``partial_rotary_factor=0.25``)."""
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(0)
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=64, position_embedding_type="rope",
                    rotary_percent=0.25)  # fmt: skip


def _logits_and_grads(model, ids, pos, **kwargs):
    model.zero_grad(set_to_none=True)
    logits = model(ids, pos, None, **kwargs)
    upstream = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    (logits * upstream).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _assert_same(model, twin, ids, pos, **kwargs):
    want, want_grads = _logits_and_grads(twin, ids, pos, **kwargs)
    got, got_grads = _logits_and_grads(model, ids, pos, **kwargs)
    assert (got - want).abs().max().item() <= TOLERANCE
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=TOLERANCE, atol=TOLERANCE, msg=name)
    return got


NORM_CASES = {  # (param_layout, rms_norm_kernel, normalization)
    "local-npu_rms_norm": ("local", "reference", "RMSNorm"),
    "te-npu_rms_norm": ("te", "reference", "RMSNorm"),
    "te-torch": ("te", "off", "RMSNorm"),  # NormColumnParallelLinear and ZeroCenteredRMSNorm
    "local-layernorm": ("local", "off", "LayerNorm"),
}


@pytest.mark.parametrize("name", list(NORM_CASES))
def test_zero_centred_norms_multiply_by_one_plus_weight(name):
    layout, rms_kernel, normalization = NORM_CASES[name]
    centred_config = tiny_config(normalization=normalization, layernorm_zero_centered_gamma=True)
    plain_config = tiny_config(normalization=normalization)
    centred = gpt(centred_config, _npu_spec(centred_config, layout, rms_kernel))
    plain = gpt(plain_config, _npu_spec(plain_config, layout, rms_kernel))
    norms = [n for n in centred.state_dict() if NORM_WEIGHT.search(n)]
    assert len(norms) == 2 * 4 + 1  # per layer input, pre-MLP, q, k; the final norm
    assert all(torch.count_nonzero(centred.state_dict()[n]) == 0 for n in norms)  # start at 0
    gen = torch.Generator().manual_seed(3)
    state = dict(centred.state_dict())
    for n in norms:
        state[n] = 0.3 * torch.randn(state[n].shape, generator=gen)
    centred.load_state_dict(state, strict=True)
    plain.load_state_dict({n: v + 1 if n in norms else v for n, v in state.items()}, strict=True)
    ids, pos = batch(b=2, s=16)
    got = _assert_same(centred, plain, ids, pos)
    plain.load_state_dict(state, strict=True)  # the test can fail: the same weights without +1
    assert (plain(ids, pos, None) - got).abs().max() > 1e-3


def test_zero_centred_norms_in_bf16_follow_the_float32_formula():
    """The torch path normalises in float32 and casts once (Qwen3_5RMSNorm's order): exactly
    the formula; the fused path's gamma is ``1 + w`` rounded to bf16: within bf16 round-off."""
    from mcore_npu.transformer.norms import NPURMSNorm, ZeroCenteredRMSNorm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    weight = 0.1 * torch.randn(64, generator=gen)
    xf = x.float()
    want = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * (1 + weight)
    torch_norm = ZeroCenteredRMSNorm(64, eps=1e-6)
    fused = NPURMSNorm(64, eps=1e-6, kernel="reference", zero_centered_gamma=True)
    with torch.no_grad():
        torch_norm.weight.copy_(weight)
        fused.weight.copy_(weight)
    torch.testing.assert_close(torch_norm(x), want.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(fused(x).float(), want, rtol=2**-7, atol=1e-2)


def _uncompiled_megatron_attention():
    """Megatron's ``SelfAttention`` with its own ``_apply_output_gate`` function uncompiled."""
    from megatron.core.transformer.attention import SelfAttention

    method = SelfAttention._apply_output_gate
    original = getattr(method, "_torchdynamo_orig_callable", method)
    return type("UncompiledGateSelfAttention", (SelfAttention,), {"_apply_output_gate": original})


def _local_spec(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        normalization=config.normalization, qk_layernorm=config.qk_layernorm
    )
    spec.submodules.self_attention.module = _uncompiled_megatron_attention()
    return spec


QWEN3_5_ATTENTION = dict(attention_output_gate=True, num_attention_heads=4, num_query_groups=2,
                         kv_channels=32)  # fmt: skip


@needs_fields("attention_output_gate", feature="the gated attention output")
@pytest.mark.parametrize("rope_kernel", ["off", "reference"])
def test_gated_attention_with_partial_rope_matches_megatrons(rope_kernel):
    from mcore_npu.transformer.self_attention import NPUSelfAttention

    config = tiny_config(**QWEN3_5_ATTENTION)
    local = _partial_rope_gpt(config, _local_spec(config))
    npu = _partial_rope_gpt(config, _npu_spec(config, rope_kernel=rope_kernel))
    assert local.rotary_pos_emb.inv_freq.numel() == 4  # 8 of 32 channels rotate
    npu.load_state_dict(local.state_dict(), strict=True)
    attention = npu.decoder.layers[0].self_attention
    assert isinstance(attention, NPUSelfAttention)
    assert attention.linear_qkv.weight.shape[0] == (2 * 4 + 2 * 2) * 32  # [q, gate, k, v]
    ids, pos = batch(b=2, s=16)
    got = _assert_same(npu, local, ids, pos)
    gate = slice(64, 128)  # group 0's gate rows ([q 2 heads | gate 2 heads | k | v] per group)
    with torch.no_grad():
        attention.linear_qkv.weight[gate] = 0.0  # gate 1/2 everywhere in group 0
    assert (npu(ids, pos, None) - got).abs().max() > 1e-3  # the gate is read


@needs_fields("attention_output_gate", feature="the gated attention output")
def test_gated_attention_packed_thd_equals_each_sequence_alone():
    from megatron.core.packed_seq_params import PackedSeqParams

    config = tiny_config(**QWEN3_5_ATTENTION)
    npu = _partial_rope_gpt(config, _npu_spec(config, rope_kernel="reference")).eval()
    lengths = (7, 12, 5)
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    ends = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=ends, cu_seqlens_kv=ends,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))  # fmt: skip
    ids = torch.cat(sequences)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = npu(ids, pos, None, packed_seq_params=params)[0]
        for seq, start, end in zip(sequences, ends[:-1], ends[1:], strict=True):
            alone = npu(seq[None], torch.arange(len(seq))[None], None)[0]
            assert (packed[start:end] - alone).abs().max() <= TOLERANCE


@needs_fields("moe_shared_expert_gate", feature="the MoE shared-expert gate")
def test_qwen3_5_moe_layer_with_the_shared_expert_gate_matches_megatrons():
    """Qwen3.5's MoE: softmax router, top-2 renormalised (``moe_router_pre_softmax=False``),
    a shared expert scaled by ``sigmoid(gate_weight @ x)``; logits and every gradient equal
    Megatron's MoE layer (SequentialMLP) with the same weights."""
    from tests.transformer.moe_models import moe_config, twin_moe_models

    config = moe_config(shared_expert=True, moe_shared_expert_gate=True,
                        moe_router_pre_softmax=False, moe_aux_loss_coeff=0.0,
                        moe_router_load_balancing_type="none")  # fmt: skip
    local, npu, names = twin_moe_models(config)
    shared = npu.decoder.layers[0].mlp.shared_experts
    assert type(shared).__name__ == "NPUSharedExpertMLP" and shared.use_shared_expert_gate
    with torch.no_grad():  # the same drawn gate in both models
        for model in (local, npu):
            for layer in model.decoder.layers:
                weight = layer.mlp.shared_experts.gate_weight
                gen = torch.Generator().manual_seed(layer.layer_number)
                weight.copy_(torch.randn(weight.shape, generator=gen))
    ids, pos = batch(b=2, s=16)
    want, want_grads = _logits_and_grads(local, ids, pos)
    got, got_grads = _logits_and_grads(npu, ids, pos)
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[names[name]], grad, rtol=1e-5, atol=1e-5, msg=name)
    assert got_grads["decoder.layers.0.mlp.shared_experts.gate_weight"].abs().sum() > 0
    with torch.no_grad():
        shared.gate_weight.mul_(-1.0)  # another gate: other logits (the gate is read)
    assert (_logits_and_grads(npu, ids, pos)[0] - got).abs().max() > 1e-4
