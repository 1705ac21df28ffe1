"""The NPU spec's DeepSeek Sparse Attention layer (``NPUDSASelfAttention``) in one process, on the
reference kernels: against the plugin's MLA where every key is chosen, against a float64
definition of the indexer written here, packed sequences, the indexer's gradients, the names and
the refusals. Parallel layouts: tests/distributed/test_mla_training.py; Hugging Face GLM-5 /
DeepSeek-V3.2: tests/dsa_hf."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.megatron_features import DSA_CONFIG_FIELDS, needs_fields
from tests.transformer.mla_models import (
    VOCAB,
    dsa_config,
    gpt,
    inputs,
    logits_and_grads,
    mla_config,
    npu_block,
    packed_params,
)

pytestmark = [
    pytest.mark.cpu_only,
    pytest.mark.usefixtures("megatron_runtime"),
    needs_fields(*DSA_CONFIG_FIELDS, feature="DeepSeek Sparse Attention"),
]

TOLERANCE = 1e-5
INDEXER = "core_attention.indexer"
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)  # fmt: skip


def _pair(topk, seed=3, **overrides):
    """A DSA model and the plugin's MLA model with the same weights (local names)."""
    dsa = gpt(dsa_config(topk, **overrides), npu_block(dsa_config(topk, **overrides)), seed)
    mla = gpt(mla_config(**overrides), npu_block(mla_config(**overrides)), seed)
    missing, unexpected = mla.load_state_dict(dsa.state_dict(), strict=False)
    assert not missing and all(INDEXER in name for name in unexpected)
    return dsa, mla


@pytest.mark.parametrize("packed", [False, True], ids=["sbhd", "thd"])
def test_choosing_every_key_is_mla(packed):
    """top-k >= the sequence: logits and every shared gradient within 1e-5 of the plugin's MLA
    (itself Megatron's MLA within 1e-5, test_mla.py): the absorbed form changes nothing."""
    dsa, mla = _pair(topk=64)
    assert type(dsa.decoder.layers[0].self_attention).__name__ == "NPUDSASelfAttention"
    (got, got_grads), (want, want_grads) = (logits_and_grads(m, packed) for m in (dsa, mla))
    assert (got - want).abs().max().item() <= TOLERANCE
    assert set(want_grads) == {n for n in got_grads if INDEXER not in n}
    worst = max((got_grads[n] - want_grads[n]).abs().max().item() for n in want_grads)
    assert worst <= TOLERANCE


def test_fewer_keys_change_exactly_the_later_positions():
    """top-k 4 of 16: positions 0-3 see at most 4 keys, so their logits are MLA's; every later
    position attends to a subset and differs."""
    dsa, mla = _pair(topk=4)
    ids, pos, _ = inputs(False)
    with torch.no_grad():
        diff = (dsa(ids, pos, None) - mla(ids, pos, None)).abs().amax(dim=-1)  # [b, s]
    assert diff[:, :4].max().item() <= TOLERANCE
    assert diff[:, 4:].min().item() > 1e-4, diff


@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs", "halves"])
def test_indexer_matches_its_definition(interleaved):
    """Index scores ``sum_h w_h relu(q_h . k) / sqrt(H * D)`` with q from the normalised q latent,
    k from LayerNorm(wk x), RoPE on the leading ``[pe]`` channels (pairs: GLM-5, halves:
    DeepSeek-V3.2), in float64 here; the layer's choice equals the top-k of those scores for
    every query whose k-th and (k+1)-th scores are apart (ReLU makes exact ties)."""
    config = dsa_config(topk=5, rope_type="rope")
    model = gpt(config, npu_block(config, dsa_indexer_rope_interleaved=interleaved), seed=4)
    core = model.decoder.layers[0].self_attention.core_attention
    seen = {}
    core.indexer.register_forward_hook(lambda m, args, out: seen.update(args=args, out=out))
    ids, pos, _ = inputs(False)
    with torch.no_grad():
        model(ids, pos, None)
        hidden, q_latent, _ = seen["args"]
        chosen = core.select(*(t.transpose(0, 1) for t in seen["out"]), _bsnd())
    scores = _definition_scores(core.indexer, hidden.double(), q_latent.double(), interleaved)
    compared = 0
    for b in range(scores.shape[0]):
        for i in range(scores.shape[1]):
            row = scores[b, i, : i + 1]
            if row.numel() > 5:
                top = row.topk(6).values
                if (top[4] - top[5]).abs() < 1e-6:
                    continue
            want = set(row.topk(min(5, row.numel())).indices.tolist())
            got = {j for j in chosen[b, i, 0].tolist() if j >= 0}
            assert got == want, (b, i)
            compared += 1
    assert compared >= 0.8 * scores.shape[0] * scores.shape[1], compared


def _bsnd():
    return {"name": "BSND", "q_ends": None, "kv_ends": None}


def _definition_scores(indexer, hidden, q_latent, interleaved):
    """``[b, s, s]`` causal index scores in float64 (hidden ``[s, b, H]``)."""
    s = indexer.settings
    rope = indexer.config.qk_pos_emb_head_dim
    w = {n: p.detach().double() for n, p in indexer.named_parameters()}
    q = (q_latent @ w["linear_wq_b.weight"].T).unflatten(-1, (s.heads, s.head_dim))
    k = F.layer_norm(hidden @ w["linear_wk.weight"].T, (s.head_dim,), w["k_norm.weight"],
                     w["k_norm.bias"], s.k_norm_eps)  # fmt: skip
    seq = hidden.shape[0]
    inv = 1.0 / (indexer.config.rotary_base ** (torch.arange(0, rope, 2).double() / rope))
    angle = torch.arange(seq).double()[:, None] * inv  # [s, rope / 2]
    cos, sin = angle.cos()[:, None, None], angle.sin()[:, None, None]  # [s, 1, 1, rope / 2]

    def turn(x):
        pe, nope = x[..., :rope], x[..., rope:]
        a, b = (pe[..., 0::2], pe[..., 1::2]) if interleaved else pe.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin, nope], dim=-1)

    q, k = turn(q), turn(k.unsqueeze(-2))[..., 0, :]  # [s, b, n, d], [s, b, d]
    weights = hidden @ w["linear_weights_proj.weight"].T  # [s, b, n]
    dots = torch.einsum("ibnd,jbd->bijn", q, k).relu()
    scores = torch.einsum("bijn,ibn->bij", dots, weights) / (s.heads * s.head_dim) ** 0.5
    hidden_keys = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    return scores.masked_fill(hidden_keys, float("-inf"))


def test_packed_sequences_each_get_their_own_logits():
    """Two sequences (11 and 7 tokens, top-k 4) packed into one thd batch: each one's logits
    equal its own run (no key chosen across the boundary)."""
    config = dsa_config(topk=4)
    model = gpt(config, npu_block(config), seed=2)
    lengths = (11, 7)
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed = model(ids, pos, None, packed_seq_params=packed_params(lengths))[0]
        start = 0
        for n in lengths:
            alone = model(ids[:, start : start + n], torch.arange(n)[None], None)[0]
            assert (packed[start : start + n] - alone).abs().max().item() <= TOLERANCE
            start += n


@pytest.mark.parametrize("packed", [False, True], ids=["sbhd", "thd"])
def test_the_indexer_trains_only_with_a_loss_coefficient(packed):
    """Coefficient 0: the indexer runs without grad (its parameters get none), every other
    parameter gets a non-zero gradient. Coefficient 0.5 (sparse and dense KL): the indexer's
    gradients are finite and non-zero, and every other gradient is bit-for-bit the same (the
    indexer reads detached inputs)."""
    off = gpt(dsa_config(topk=4), npu_block(dsa_config(topk=4)), seed=6)
    _, off_grads = logits_and_grads(off, packed)
    assert not [n for n in off_grads if INDEXER in n]
    assert all(g.abs().sum() > 0 for g in off_grads.values())
    for sparse_loss in (True, False):
        config = dsa_config(topk=4, coeff=0.5, sparse_loss=sparse_loss)
        on = gpt(config, npu_block(config), seed=6)
        _, grads = logits_and_grads(on, packed)
        indexer = {n: g for n, g in grads.items() if INDEXER in n}
        assert len(indexer) == 2 * 5  # two layers: wq_b, wk, k_norm weight / bias, weights_proj
        assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in indexer.values())
        for name, grad in off_grads.items():
            assert torch.equal(grads[name], grad), (sparse_loss, name)


def test_the_indexer_loss_is_a_mean_over_query_rows():
    """As Megatron's: the summed KL over this rank's query rows times the coefficient. The same
    sequence twice in a batch gives the indexer the gradient of one (a sum would double it); the
    main loss is zeroed, so only the indexer loss reaches the indexer."""
    config = dsa_config(topk=4, coeff=0.5)
    model = gpt(config, npu_block(config), seed=6)
    ids, pos, _ = inputs(False)
    grads = []
    for batch in (1, 2):
        model.zero_grad(set_to_none=True)
        logits = model(ids[:1].expand(batch, -1), pos[:1].expand(batch, -1), None)
        (logits.sum() * 0).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if INDEXER in n})
    assert grads[0] and all(g.abs().sum() > 0 for g in grads[0].values())
    for name, one in grads[0].items():
        torch.testing.assert_close(grads[1][name], one, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("packed", [False, True], ids=["sbhd", "thd"])
def test_layers_sharing_a_top_k_attend_to_their_source_layers_keys(packed, monkeypatch):
    """``dsa_indexer_topk_freq=2`` (offset 1, Megatron 0.19's rule; GLM-5's ``shared`` layers):
    of 4 layers, 2 and 4 have no indexer and attend to the keys layers 1 and 3 chose in the
    same forward (the very tensors), so the indexer runs twice; the model trains (finite,
    non-zero gradients); and it differs from the model whose every layer indexes."""
    from mcore_npu.ops import dsa
    from mcore_npu.transformer.dsa import core

    config = dsa_config(topk=4, num_layers=4, coeff=0.5)
    sharing = dict(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)  # spec keywords
    model = gpt(config, npu_block(config, **sharing), seed=6)
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert [c.indexer is None for c in cores] == [False, True, False, True]
    assert [c.source for c in cores] == [1, 1, 3, 3]
    seen, attend = [], dsa.sparse_flash_attention

    def recording(*args, **kwargs):
        seen.append(args[3])
        return attend(*args, **kwargs)

    monkeypatch.setattr(core.dsa, "sparse_flash_attention", recording)
    logits, grads = logits_and_grads(model, packed)
    assert len(seen) == 4 and seen[1] is seen[0] and seen[3] is seen[2]
    assert not torch.equal(seen[0], seen[2])
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    assert not [n for n in grads if "layers.1." in n and INDEXER in n]
    own = gpt(config, npu_block(config), seed=6)
    own.load_state_dict(model.state_dict(), strict=False)
    monkeypatch.setattr(core.dsa, "sparse_flash_attention", attend)
    assert (logits_and_grads(own, packed)[0] - logits).abs().max() > 1e-4


def test_layers_sharing_a_top_k_recompute_to_the_same_gradients():
    """Full recompute, one layer at a time (the backward recomputes layer 2 before layer 1):
    the layer reusing layer 1's top-k reads the same micro-batch's choice, so the logits and
    every gradient equal the run without recompute."""
    sharing = dict(dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1)
    runs = []
    for recompute in ({}, FULL_RECOMPUTE):
        config = dsa_config(topk=4, num_layers=4, coeff=0.5, **recompute)
        runs.append(logits_and_grads(gpt(config, npu_block(config, **sharing), seed=6), False))
    (logits, grads), (again, regrads) = runs
    assert torch.equal(logits, again) and grads.keys() == regrads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(regrads[name], grad, rtol=0, atol=1e-7, msg=name)


def test_te_layout_names():
    """In the te layout the latent norms stay apart (the indexer reads the normalised q latent,
    as Megatron 0.19's DSA spec has it) and the indexer's names are 0.19's."""
    config = dsa_config(topk=4)
    model = gpt(config, npu_block(config, param_layout="te"))
    names = {n.removeprefix("decoder.layers.0.") for n, _ in model.named_parameters()
             if n.startswith("decoder.layers.0.")}  # fmt: skip
    attention = {n.removeprefix("self_attention.") for n in names if "self_attention" in n}
    assert attention == {
        "linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight",
        "linear_kv_down_proj.weight", "kv_layernorm.weight", "linear_kv_up_proj.weight",
        "linear_proj.weight", f"{INDEXER}.linear_wq_b.weight", f"{INDEXER}.linear_wk.weight",
        f"{INDEXER}.k_norm.weight", f"{INDEXER}.k_norm.bias",
        f"{INDEXER}.linear_weights_proj.weight",
    }  # fmt: skip
    assert "input_layernorm.weight" in names


def test_no_cuda_package_is_imported():
    """Building and training a DSA layer imports none of Transformer Engine, the Hadamard
    transform, TileLang or FlashMLA."""
    config = dsa_config(topk=4, coeff=0.5)
    logits_and_grads(gpt(config, npu_block(config)), True)
    loaded = {"transformer_engine", "fast_hadamard_transform", "tilelang", "flash_mla"}
    assert not loaded & {name.split(".")[0] for name in sys.modules}


def test_inference_is_refused():
    config = dsa_config(topk=4)
    attention = gpt(config, npu_block(config)).decoder.layers[0].self_attention
    with pytest.raises(ValueError, match="inference_context"):
        attention(torch.zeros(3, 1, 64), None, inference_context=object())


def _fields(**changes):
    fields = dict(
        multi_latent_attention=True, qk_pos_emb_head_dim=8, dsa_indexer_n_heads=4,
        dsa_indexer_head_dim=16, dsa_indexer_topk=4, dsa_indexer_loss_coeff=0.0,
        dsa_indexer_use_sparse_loss=False, layernorm_epsilon=1e-5, context_parallel_size=1,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
    )  # fmt: skip
    return SimpleNamespace(**{**fields, **changes})


@pytest.mark.parametrize("changes,named", [
    ({"multi_latent_attention": False}, "multi_latent_attention"),
    ({"dsa_indexer_head_dim": 4}, "dsa_indexer_head_dim"),
    ({"dsa_indexer_n_heads": None}, "dsa_indexer_n_heads"),
    ({"dsa_indexer_topk": 0}, "dsa_indexer_topk"),
    ({"dsa_indexer_topk_freq": 2, "pipeline_model_parallel_size": 2}, "dsa_indexer_topk_freq"),
    ({"dsa_indexer_scoring_relu": False}, "dsa_indexer_scoring_relu"),
    ({"dsa_indexer_loss_coeff": -1.0}, "dsa_indexer_loss_coeff"),
])  # fmt: skip
def test_settings_refuse_naming_the_field(changes, named):
    from mcore_npu.transformer.dsa import dsa_settings

    with pytest.raises(ValueError, match=f"^{named}: "):
        dsa_settings(_fields(**changes))


def test_spec_keywords_and_their_defaults():
    from mcore_npu.transformer.dsa import dsa_settings
    from mcore_npu.transformer.dsa.settings import check_cp_comm_type

    plain = dsa_settings(_fields())
    assert (plain.rope_interleaved, plain.k_norm_eps, plain.trains_indexer) == (False, 1e-5, False)
    given = dsa_settings(_fields(dsa_indexer_loss_coeff=0.1), True, 1e-6)
    assert (given.rope_interleaved, given.k_norm_eps, given.trains_indexer) == (True, 1e-6, True)
    with pytest.raises(ValueError, match="^dsa_indexer_rope_interleaved: "):
        dsa_settings(_fields(), "yes")
    with pytest.raises(ValueError, match="^cp_comm_type: 'p2p'"):
        check_cp_comm_type("p2p")


def test_config_admits_context_parallelism_for_dsa_only():
    """Megatron 0.16.1 asserts CP == 1 for DSA; ``DSATransformerConfig`` admits CP (the layer
    gathers the keys) and still refuses Megatron's fused RoPE."""
    from mcore_npu.transformer.dsa import DSATransformerConfig

    fields = {**vars(dsa_config(topk=4))}
    keep = {k: fields[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
            "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
            "experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim",
            "dsa_indexer_topk")}  # fmt: skip
    config = DSATransformerConfig(**keep, context_parallel_size=2, apply_rope_fusion=False)
    assert config.experimental_attention_variant == "dsa"
    with pytest.raises(ValueError, match="^apply_rope_fusion: "):
        DSATransformerConfig(**keep, context_parallel_size=2, apply_rope_fusion=True)


def test_the_dense_indexer_loss_refuses_the_fused_kernel():
    """The fused KL loss covers the chosen keys only: with ``dsa_indexer_use_sparse_loss=False``
    naming it is refused when the layer is built (``auto`` takes the reference)."""
    config = dsa_config(topk=4, coeff=0.5, sparse_loss=False)
    with pytest.raises(ValueError, match="^indexer_loss_kernel: 'torch_npu' with dsa_indexer_use"):
        gpt(config, npu_block(config, indexer_loss_kernel="torch_npu"))
    core = gpt(config, npu_block(config)).decoder.layers[0].self_attention.core_attention
    assert core.kernels == {"indexer": "reference", "attention": "reference", "loss": "reference"}
