"""The NPU spec against Megatron's local spec: same parameters, same numbers (fp32, CPU).

Real megatron-core models on one gloo process; the attention kernel is the reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.transformer.megatron_models import (
    VOCAB,
    batch,
    gpt,
    local_spec,
    npu_spec,
    tiny_config,
    twin_models,
)

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]


def _logits_and_grads(model, ids, pos, mask):
    model.zero_grad()
    logits = model(ids, pos, mask)
    logits.float().pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return logits.detach(), grads


def _assert_same(local, npu, ids, pos, mask_local, mask_npu, tol=1e-5):
    want, want_grads = _logits_and_grads(local, ids, pos, mask_local)
    got, got_grads = _logits_and_grads(npu, ids, pos, mask_npu)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=tol, atol=tol, msg=name)


def test_causal_without_mask_matches_local_spec():
    local, npu = twin_models(tiny_config())
    ids, pos = batch()
    _assert_same(local, npu, ids, pos, None, None)


def test_explicit_causal_mask_matches_local_spec():
    local, npu = twin_models(tiny_config())
    ids, pos = batch()
    causal = torch.ones(16, 16, dtype=torch.bool).triu(1)[None, None]  # True = masked out
    _assert_same(local, npu, ids, pos, causal, causal)
    # and the explicit causal mask equals attention_mask=None through the NPU spec
    torch.testing.assert_close(npu(ids, pos, causal), npu(ids, pos, None), rtol=0, atol=0)


def test_explicit_padding_mask_matches_local_spec():
    from mcore_npu.masks import build_npu_attention_mask

    local, npu = twin_models(tiny_config())
    ids, pos = batch()
    keep = torch.ones(2, 16, dtype=torch.bool)
    keep[0, 11:] = False  # right padding
    keep[1, :3] = False  # left padding
    mask = build_npu_attention_mask(keep)  # [2, 1, 16, 16], True = masked out
    want, _ = _logits_and_grads(local, ids, pos, mask)
    got, _ = _logits_and_grads(npu, ids, pos, mask)
    # padded query rows see no key: Megatron's local softmax gives them a uniform average, the
    # operator contract gives 0 (undefined on hardware); compare the real rows only
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)
    _assert_real_row_grads_match(local, npu, ids, pos, mask, keep)


@pytest.mark.parametrize("batch_dim", [2, 1])
def test_megatron_b11s_padding_mask_matches_local_spec_on_every_row(batch_dim):
    # the mask shape of Megatron's own test_attention.py; every batch entry keeps some keys, so
    # every query row attends to something and all rows are compared
    local, npu = twin_models(tiny_config())
    ids, pos = batch()
    mask = torch.zeros(batch_dim, 1, 1, 16, dtype=torch.bool)  # True = masked out
    mask[0, ..., 11:] = True
    mask[-1, ..., :3] = True
    _assert_same(local, npu, ids, pos, mask, mask)


def _assert_real_row_grads_match(local, npu, ids, pos, mask, keep):
    for model in (local, npu):
        model.zero_grad()
        logits = model(ids, pos, mask)
        (logits[keep].pow(2).mean()).backward()
    for (name, p_local), (_, p_npu) in zip(local.named_parameters(), npu.named_parameters()):
        torch.testing.assert_close(p_npu.grad, p_local.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_sliding_window_matches_local_spec_dense_band():
    config = tiny_config(window_size=(3, 0))
    local, npu = twin_models(config)
    ids, pos = batch()
    # Megatron's local attention builds its dense banded mask itself when window_size is set
    _assert_same(local, npu, ids, pos, None, None)
    # and the window really bands: it differs from full causal attention
    full = gpt(tiny_config(), npu_spec(tiny_config()))
    full.load_state_dict(npu.state_dict())
    assert not torch.allclose(full(ids, pos, None), npu(ids, pos, None))


def test_query_key_layer_scaling_keeps_the_net_scale():
    config = tiny_config(apply_query_key_layer_scaling=True, attention_softmax_in_fp32=True)
    local, npu = twin_models(config)
    ids, pos = batch()
    _assert_same(local, npu, ids, pos, None, None)


def test_packed_thd_gives_each_sequence_its_own_logits():
    from megatron.core.packed_seq_params import PackedSeqParams

    model = gpt(tiny_config(), npu_spec(tiny_config()))
    lengths = [5, 9, 2]
    gen = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, VOCAB, (1, n), generator=gen) for n in lengths]
    ids = torch.cat(sequences, dim=1)  # [1, T]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 14, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=9, max_seqlen_kv=9)  # fmt: skip
    packed = model(ids, pos, None, packed_seq_params=params)  # [1, T, V]
    start = 0
    for seq, n in zip(sequences, lengths):
        alone = model(seq, torch.arange(n)[None], None)
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-5)
        start += n


def test_state_dict_keys_equal_and_load_both_ways():
    config = tiny_config()
    local = gpt(config, local_spec(config))
    npu = gpt(config, npu_spec(config), seed=1)
    assert list(local.state_dict().keys()) == list(npu.state_dict().keys())
    npu.load_state_dict(local.state_dict(), strict=True)
    local2 = gpt(config, local_spec(config), seed=2)
    local2.load_state_dict(npu.state_dict(), strict=True)
    for (name, a), (_, b) in zip(local.state_dict().items(), local2.state_dict().items()):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_decoder_block_spec_with_moe_layers_matches_local_block():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    config = tiny_config(num_moe_experts=2, moe_layer_freq=[0, 1], moe_router_topk=2,
                         moe_ffn_hidden_size=64, moe_token_dispatcher_type="allgather")  # fmt: skip
    local = gpt(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                   normalization="RMSNorm"))  # fmt: skip
    npu = gpt(config, get_gpt_decoder_block_npu_spec(config, kernel="reference",
                                                     param_layout="local",
                                                     normalization="RMSNorm"), seed=5)  # fmt: skip
    assert list(local.state_dict().keys()) == list(npu.state_dict().keys())
    npu.load_state_dict(local.state_dict(), strict=True)
    assert "mlp.experts" in "".join(npu.state_dict().keys())
    attention = [layer.self_attention.core_attention for layer in npu.decoder.layers]
    assert [type(a).__name__ for a in attention] == ["NPUFusionAttention"] * 2
    # Forward/backward numerics of MoE layers: tests/transformer/test_moe.py (Megatron's own
    # router cannot run here without TE; the NPU spec's NPUTopKRouter can).


def test_block_spec_shares_one_seq_lengths_memo_across_layers():
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    config = tiny_config(num_layers=3)
    block = get_gpt_decoder_block_npu_spec(config)
    memos = {id(spec.submodules.self_attention.submodules.core_attention.params["seq_lengths_memo"])
             for spec in block.layer_specs}  # fmt: skip
    assert len(memos) == 1


def test_norms_support_sequence_parallel_and_tag_their_params():
    from types import SimpleNamespace

    from mcore_npu.transformer.norms import SequenceParallelNorm

    for normalization, cls in (("RMSNorm", torch.nn.RMSNorm), ("LayerNorm", torch.nn.LayerNorm)):
        config = SimpleNamespace(normalization=normalization, sequence_parallel=True,
                                 layernorm_zero_centered_gamma=False)  # fmt: skip
        norm = SequenceParallelNorm(config, 8, eps=1e-6)
        assert isinstance(norm, cls)
        assert all(p.sequence_parallel for p in norm.parameters())
        x = torch.randn(3, 8)
        torch.testing.assert_close(norm(x), cls(8, eps=1e-6)(x))


def test_gpt_swiglu_is_what_the_config_says():
    config = tiny_config()
    model = gpt(config, npu_spec(config))
    mlp = model.decoder.layers[0].mlp
    assert mlp.config.gated_linear_unit and mlp.config.activation_func is F.silu
    assert mlp.linear_fc1.weight.shape == (2 * 128, 64)
