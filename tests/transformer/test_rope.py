"""Fused RoPE (``NPURotarySelfAttention``, ``npu_rotary_mul``) inside a real GPTModel against
Megatron's own unfused RoPE: the same weights, logits and every gradient within 1e-6 (fp32).

The stand-in torch_npu (no NPU here; ``tests/fused_standin.py``: records each call and answers
with the reference) shows the operator's layout and mode, and that cos/sin are made once per
step for the whole model."""

from __future__ import annotations

import pytest
import torch

from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec
from mcore_npu.transformer.rope import NPURotarySelfAttention, packed_positions
from tests.fused_standin import install
from tests.transformer.megatron_models import VOCAB, batch, tiny_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

TOLERANCE = 1e-6


def _spec(config, rope_kernel, param_layout="local"):
    return get_gpt_layer_npu_spec(
        normalization=config.normalization, qk_layernorm=config.qk_layernorm, kernel="reference",
        param_layout=param_layout, rms_norm_kernel="reference", swiglu_kernel="reference",
        grouped_matmul_kernel="reference", rope_kernel=rope_kernel,
    )  # fmt: skip


def _gpt(config, spec, **model_kwargs):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(0)
    kwargs = dict(vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="rope")
    kwargs.update(model_kwargs)
    return GPTModel(config, transformer_layer_spec=spec, **kwargs)


def _twins(config, param_layout="local", **model_kwargs):
    """Megatron's RoPE (rope_kernel='off') and the fused one, with the same weights."""
    unfused = _gpt(config, _spec(config, "off", param_layout), **model_kwargs)
    fused = _gpt(config, _spec(config, "reference", param_layout), **model_kwargs)
    fused.load_state_dict(unfused.state_dict(), strict=True)
    return unfused, fused


def _logits_and_grads(model, ids, pos, **kwargs):
    model.zero_grad(set_to_none=True)
    logits = model(ids, pos, None, **kwargs)
    upstream = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5))
    (logits * upstream).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _assert_same(unfused, fused, ids, pos, **kwargs):
    want, want_grads = _logits_and_grads(unfused, ids, pos, **kwargs)
    cache = _rope_layers(fused)[0].rope_cache
    built = cache.builds
    got, got_grads = _logits_and_grads(fused, ids, pos, **kwargs)
    assert cache.builds == built + 1  # the fused path ran (cos/sin made once for all layers)
    assert (got - want).abs().max().item() <= TOLERANCE
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 0
    worst = max((got_grads[n] - want_grads[n]).abs().max().item() for n in want_grads)
    assert worst <= TOLERANCE, worst
    return want


def _rope_layers(model):
    return [layer.self_attention for layer in model.decoder.layers]


CASES = {
    "sbhd": ({}, {}),
    "interleaved": ({"rotary_interleaved": True}, {}),
    "rotary_percent_half": ({}, {"rotary_percent": 0.5}),
    "te_layout": ({}, {}),  # param_layout='te': the norm fused into linear_qkv
    "no_qk_norm": ({"qk_layernorm": False}, {}),
    "no_rope_freq": ({"no_rope_freq": [0, 1]}, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_rope_equals_megatrons_rope(name):
    config_kwargs, model_kwargs = CASES[name]
    config = tiny_config(**config_kwargs)
    layout = "te" if name == "te_layout" else "local"
    unfused, fused = _twins(config, layout, **model_kwargs)
    assert all(type(a) is NPURotarySelfAttention for a in _rope_layers(fused))
    assert not any(isinstance(a, NPURotarySelfAttention) for a in _rope_layers(unfused))
    ids, pos = batch(b=2, s=16)
    _assert_same(unfused, fused, ids, pos)


def test_fused_rope_is_not_a_no_op():
    """The comparison can fail: the same model without any RoPE differs."""
    config = tiny_config()
    unfused, fused = _twins(config)
    ids, pos = batch(b=2, s=16)
    with_rope = fused(ids, pos, None)
    without = _gpt(config, _spec(config, "reference"), position_embedding_type="none")
    without.load_state_dict(unfused.state_dict(), strict=False)
    assert (without(ids, pos, None) - with_rope).abs().max() > 1e-3


def _yarn_config():
    config = tiny_config(rotary_interleaved=False)
    # GPTModel reads YaRN's settings from the config as Megatron-LM sets them (attributes)
    for key, value in dict(yarn_rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=16,
                           yarn_beta_fast=32.0, yarn_beta_slow=1.0, yarn_mscale=1.0,
                           yarn_mscale_all_dim=0.0,
                           yarn_correction_range_round_to_int=True).items():  # fmt: skip
        setattr(config, key, value)
    return config


def test_yarn_with_mscale_equals_megatrons_rope():
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    config = _yarn_config()
    unfused, fused = _twins(config, position_embedding_type="yarn")
    assert isinstance(fused.rotary_pos_emb, YarnRotaryEmbedding)
    assert _rope_layers(fused)[0].rope_mscale > 1.01  # the concentration factor is in play
    ids, pos = batch(b=2, s=16)
    _assert_same(unfused, fused, ids, pos)


def _packed(cu, max_len, padded=None):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                           max_seqlen_q=max_len, max_seqlen_kv=max_len)  # fmt: skip


@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_thd_restarts_positions_per_sequence(interleaved):
    config = tiny_config(rotary_interleaved=interleaved)
    unfused, fused = _twins(config)
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    ids, pos = batch(b=1, s=16)
    _assert_same(unfused, fused, ids, pos, packed_seq_params=_packed(cu, 9))


def test_packed_thd_with_padded_offsets():
    config = tiny_config()
    unfused, fused = _twins(config)
    real = torch.tensor([0, 4, 13, 15], dtype=torch.int32)
    padded = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    ids, pos = batch(b=1, s=16)
    _assert_same(unfused, fused, ids, pos, packed_seq_params=_packed(real, 9, padded))


def test_packed_positions_follow_megatrons_cp_chunks():
    assert packed_positions((3, 5)) == [0, 1, 2, 0, 1]
    assert packed_positions((3, 5), exact=True) == [0, 1, 2, 3, 4]
    # one sequence of 8 over CP=2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert packed_positions((8,), 2, 0) == [0, 1, 6, 7]
    assert packed_positions((8,), 2, 1) == [2, 3, 4, 5]
    assert packed_positions((4, 12), 2, 1) == [1, 2, 2, 3, 4, 5]


def test_kv_cache_decode_rotates_the_new_key_before_caching():
    """Static inference: prefill of 6 tokens, then one decode step, fused against unfused."""
    from megatron.core.inference.contexts import StaticInferenceContext

    config = tiny_config()
    unfused, fused = _twins(config)
    ids, pos = batch(b=2, s=7)
    outs = []
    for model in (unfused, fused):
        model.eval()
        context = StaticInferenceContext(max_batch_size=2, max_sequence_length=16)
        with torch.no_grad():
            prefill = model(
                ids[:, :6], pos[:, :6], None, inference_context=context, runtime_gather_output=True
            )
            context.sequence_len_offset += 6
            decode = model(
                ids[:, 6:], pos[:, 6:], None, inference_context=context, runtime_gather_output=True
            )
        outs.append((prefill, decode, context))
    (want_p, want_d, want_ctx), (got_p, got_d, got_ctx) = outs
    assert (got_p - want_p).abs().max() <= TOLERANCE
    assert (got_d - want_d).abs().max() <= TOLERANCE
    # Megatron caches the raw key and rotates the whole cache per step; ours caches it rotated
    raw_key = want_ctx.key_value_memory_dict[1][0][:7]
    rotated_key = got_ctx.key_value_memory_dict[1][0][:7]
    assert (raw_key - rotated_key).abs().max() > 1e-3
    # and the decode equals the full-sequence forward's last position
    with torch.no_grad():
        full = fused(ids, pos, None)
    assert (full[:, 6:] - got_d).abs().max() <= 1e-5


def test_standin_records_sbnd_calls_and_cos_sin_made_once_per_step(monkeypatch):
    config = tiny_config(num_layers=3)
    model = _gpt(config, _spec(config, "torch_npu"))
    standin = install(monkeypatch)
    ids, pos = batch(b=2, s=16)
    cache = _rope_layers(model)[0].rope_cache
    assert all(a.rope_cache is cache for a in _rope_layers(model))  # one per model
    model(ids, pos, None).sum().backward()
    calls = [c for c in standin.calls if c[0] == "npu_rotary_mul"]
    assert len(calls) == 2 * 3  # q and k in each layer
    for i, (_, (x, r1, r2), kwargs) in enumerate(calls):
        heads = 4 if i % 2 == 0 else 2  # q: 4 heads, k: 2 groups (GQA)
        assert x.shape == (16, 2, heads, 16)  # SBND
        assert r1.shape == r2.shape == (16, 1, 1, 16)  # S11D
        assert kwargs == {"rotary_mode": "half"}
    assert len({id(r1) for _, (_, r1, _), _ in calls}) == 1  # one cos for all layers
    assert cache.builds == 1
    model(ids, pos, None)  # a second step: Megatron's angles tensor is the same (lru_cache)
    assert cache.builds == 1


def test_standin_sees_interleave_and_packed_layout(monkeypatch):
    config = tiny_config(num_layers=2, rotary_interleaved=True)
    model = _gpt(config, _spec(config, "torch_npu"))
    standin = install(monkeypatch)
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    ids, pos = batch(b=1, s=16)
    memo = _rope_layers(model)[0].seq_lengths_memo
    model(ids, pos, None, packed_seq_params=_packed(cu, 9))
    calls = [c for c in standin.calls if c[0] == "npu_rotary_mul"]
    assert len(calls) == 4 and all(kw == {"rotary_mode": "interleave"} for *_, kw in calls)
    assert {tuple(x.shape[:2]) for _, (x, _, _), _ in calls} == {(16, 1)}  # [T, 1, N, D]
    assert _rope_layers(model)[0].rope_cache.builds == 1
    assert memo.conversions == 1  # the attention's memo: one host copy for all layers


@pytest.mark.parametrize("kind", ["dynamic", "flash_decode", "cross", "per_head"])
def test_megatron_keeps_rope_where_the_fused_path_cannot_apply(kind):
    config = tiny_config(num_layers=1)
    model = _gpt(config, _spec(config, "reference"))
    attention = _rope_layers(model)[0]
    angles = torch.zeros(4, 1, 1, 16)
    context = None
    if kind == "dynamic":
        context = type("Dynamic", (), {"is_static_batching": lambda self: False})()
    elif kind == "flash_decode":
        attention.config = tiny_config(num_layers=1, flash_decode=True)
        context = type("Static", (), {"is_static_batching": lambda self: True})()
    elif kind == "per_head":
        angles = torch.zeros(4, 1, 2, 16)  # per-head angles
    kv = torch.zeros(4, 1, 64) if kind == "cross" else None
    assert attention._fused_angles(angles, kv, context) is None
    assert attention._fused_angles(torch.zeros(4, 1, 1, 16), None, None) is not None


def test_unknown_rope_kernel_is_refused():
    with pytest.raises(ValueError, match="rope_kernel: unknown value 'npu'"):
        get_gpt_layer_npu_spec(rope_kernel="npu")


def test_mrope_model_rotates_on_the_fused_path_with_megatrons_numbers():
    """mRoPE (per-sample angles [s, b, 1, rot] from [3, b, s] positions, different per sample
    and axis): the fused module rotates them through rotary_mul, cos/sin once for all layers, and
    the logits are Megatron's own mRoPE's."""
    config = tiny_config(mrope_section=[2, 3, 3])  # head dim 16: 8 frequencies
    unfused, fused = _twins(config, position_embedding_type="mrope")
    ids, _ = batch(b=2, s=16)
    pos = torch.stack([torch.randperm(16).expand(2, 16) + a for a in range(3)])
    pos[:, 1] = pos[:, 1].flip(-1)
    want, got = unfused(ids, pos, None), fused(ids, pos, None)
    assert (got - want).abs().max() <= TOLERANCE
    assert _rope_layers(fused)[0].rope_cache.builds == 1


def test_bf16_model_gets_megatrons_numbers():
    """cos/sin are cast to q's dtype as Megatron casts them: bf16 logits agree exactly."""
    config = tiny_config(params_dtype=torch.bfloat16, bf16=True)
    unfused, fused = (m.bfloat16() for m in _twins(config))
    ids, pos = batch(b=2, s=16)
    want, got = unfused(ids, pos, None), fused(ids, pos, None)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert _rope_layers(fused)[0].rope_cache.builds == 1
