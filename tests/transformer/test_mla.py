"""Multi-latent attention on the NPU spec (``NPUMLASelfAttention``) against Megatron's own MLA.

Real megatron-core models on one gloo process (fp32, CPU). The oracle is Megatron's
``MLASelfAttention`` from its local MLA spec, built with its module's ``HAVE_TE`` fixed to False
for the construction only (tests/transformer/mla_models.py), with a core attention written from
the definition. The NPU spec's model (reference kernels) gets the oracle's weights.
"""

from __future__ import annotations

import types

import pytest
import torch

from mcore_npu.ops import reference, value_padding
from tests.transformer.mla_models import (
    gpt,
    logits_and_grads,
    megatron_mla_without_te,
    megatron_oracle,
    mla_config,
    npu_block,
)
from tests.transformer.te_names import disk_key, expected_names

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

TOLERANCE = 1e-5


def _worst(got, want) -> tuple[float, float]:
    """Max |difference| of the logits and of any parameter gradient (same names required)."""
    assert set(got[1]) == set(want[1])
    grads = max((got[1][name] - want[1][name]).abs().max().item() for name in want[1])
    return (got[0] - want[0]).abs().max().item(), grads


EQUALITY = [(packed, q_lora, True) for packed in (False, True) for q_lora in (32, None)]
EQUALITY.append((False, 32, False))  # no latent norms


EQUALITY_IDS = [f"{'thd' if p else 'sbhd'}-{'q_lora' if q else 'no_q_lora'}"
                f"{'' if qk else '-no_latent_norms'}" for p, q, qk in EQUALITY]  # fmt: skip


@pytest.mark.parametrize("packed,q_lora_rank,qk", EQUALITY, ids=EQUALITY_IDS)
def test_npu_spec_equals_megatrons_mla(packed, q_lora_rank, qk):
    """Logits and every gradient within 1e-5 of Megatron's MLASelfAttention (yarn RoPE), with
    Megatron's RoPE (rope_kernel off) and with the fused path on the rope slice (reference);
    qk: the latent norms (qk_layernorm)."""
    config = mla_config(q_lora_rank, qk_layernorm=qk)
    oracle = megatron_oracle(config)
    want = logits_and_grads(oracle, packed)
    for rope_kernel in ("off", "reference"):
        model = gpt(config, npu_block(config, rope_kernel=rope_kernel), seed=5)
        attention = model.decoder.layers[0].self_attention
        assert type(attention).__name__ == "NPUMLASelfAttention"
        assert type(attention.core_attention).__name__ == "NPUFusionAttention"
        assert attention.core_attention.softmax_scale == attention.softmax_scale
        model.load_state_dict(oracle.state_dict(), strict=True)
        logits, grads = _worst(logits_and_grads(model, packed), want)
        assert logits <= TOLERANCE and grads <= TOLERANCE, (rope_kernel, logits, grads)


def test_mindspeed_yarn_keys_reach_mla_and_plain_rope_too():
    """verl's DeepSeek recipe spells yarn the MindSpeed way; through the recipe vocabulary it
    becomes Megatron's MLA config, whose softmax scale carries yarn's mscale (mscale_all_dim)
    and whose NPU-spec model equals Megatron's. rope_type='rope' also equals Megatron (its
    RotaryEmbedding on the rope slice), fused or not."""
    import math

    from megatron.core.models.common.embeddings import _yarn_get_mscale
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from mcore_npu.transformer.recipe_keys import RecipeContext, translate

    recipe = {"rope_scaling_type": "yarn", "yarn_scaling_factor": 8.0,
              "rope_scaling_mscale": 1.0, "rope_scaling_mscale_all_dim": 0.7}  # fmt: skip
    plan = translate(recipe, RecipeContext(config_class=MLATransformerConfig, num_layers=2))
    assert plan.megatron == {"rope_type": "yarn", "rotary_scaling_factor": 8.0, "mscale": 1.0,
                             "mscale_all_dim": 0.7}  # fmt: skip
    for config in (mla_config(**plan.megatron), mla_config(rope_type="rope")):
        oracle = megatron_oracle(config)
        want = logits_and_grads(oracle, False)
        for rope_kernel in ("off", "reference"):
            model = gpt(config, npu_block(config, rope_kernel=rope_kernel), seed=5)
            model.load_state_dict(oracle.state_dict())
            assert max(_worst(logits_and_grads(model, False), want)) <= TOLERANCE
            scale = model.decoder.layers[0].self_attention.core_attention.softmax_scale
            assert scale == oracle.decoder.layers[0].self_attention.softmax_scale
    yarn = gpt(mla_config(**plan.megatron), npu_block(mla_config(**plan.megatron)))
    mscale = _yarn_get_mscale(8.0, 0.7)
    assert yarn.decoder.layers[0].self_attention.core_attention.softmax_scale == pytest.approx(
        mscale * mscale / math.sqrt(24))  # fmt: skip


def test_layer_spec_builds_mla_in_both_layouts():
    """get_gpt_layer_npu_spec(multi_latent_attention=True) builds (no TE, Megatron's flag
    untouched) in both layouts, and the TE layout computes what the local layout does."""
    from megatron.core.transformer import multi_latent_attention as megatron_mla

    from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec
    from mcore_npu.transformer.mla import megatron_mla_constructs
    from mcore_npu.transformer.param_layout import match_names, rename_state_dict

    have_te = megatron_mla.HAVE_TE  # 0.16.1: True (and Megatron's constructor fails without TE)
    assert megatron_mla_constructs() == (not have_te)  # no TE here: only the flag decides
    config = mla_config()
    models = {}
    for layout in ("local", "te"):
        spec = get_gpt_layer_npu_spec(multi_latent_attention=True, qk_layernorm=True,
                                      normalization="RMSNorm", kernel="reference",
                                      param_layout=layout)  # fmt: skip
        models[layout] = gpt(config, spec, seed=3 if layout == "local" else 4)
    assert have_te == megatron_mla.HAVE_TE  # still Megatron's value
    local, te = models["local"], models["te"]
    with torch.no_grad():  # non-trivial norm weights, so that a dropped norm would show
        for name, p in local.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    te.load_state_dict(rename_state_dict(local.state_dict(), te.state_dict()), strict=True)
    te_logits, te_grads = logits_and_grads(te, False)
    want = logits_and_grads(local, False)
    local_names = match_names(want[1], te_grads)  # {te name: local name}
    got = (te_logits, {local_names[name]: grad for name, grad in te_grads.items()})
    assert max(_worst(got, want)) <= 1e-6


@pytest.mark.parametrize("layout", ["local", "te"])
def test_the_latent_norms_take_their_own_epsilon(layout):
    """``mla_latent_norm_epsilon`` sets the q / kv latent norms' epsilon (apart, or fused into
    the up projections in the te layout) and no other norm's; it changes the logits; a
    non-positive value is refused naming the keyword."""
    config = mla_config(layernorm_epsilon=1e-5)
    plain = gpt(config, npu_block(config, param_layout=layout), seed=3)
    spec = npu_block(config, param_layout=layout, mla_latent_norm_epsilon=0.5)
    model = gpt(config, spec, seed=3)
    epsilons = {name: module.eps for name, module in model.named_modules()
                if isinstance(getattr(module, "eps", None), float)}  # fmt: skip
    latent = ("q_layernorm", "kv_layernorm", "linear_q_up_proj", "linear_kv_up_proj")
    assert {eps for name, eps in epsilons.items() if name.endswith(latent)} == {0.5}
    assert {eps for name, eps in epsilons.items() if not name.endswith(latent)} == {1e-5}
    assert len([name for name in epsilons if name.endswith(latent)]) == 2 * config.num_layers
    assert (
        logits_and_grads(model, False)[0] - logits_and_grads(plain, False)[0]
    ).abs().max() > 1e-3
    with pytest.raises(ValueError, match="^mla_latent_norm_epsilon: pass a positive float"):
        npu_block(config, mla_latent_norm_epsilon=0.0)


def test_the_latent_norm_epsilon_leaves_other_attentions_qk_norms_alone():
    """On a layer without MLA, ``mla_latent_norm_epsilon`` changes no norm: the q / k norms of
    ``qk_layernorm`` keep ``layernorm_epsilon``."""
    from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec
    from tests.transformer.megatron_models import tiny_config

    config = tiny_config(qk_layernorm=True, layernorm_epsilon=1e-5)
    spec = get_gpt_layer_npu_spec(qk_layernorm=True, kernel="reference", param_layout="local",
                                  mla_latent_norm_epsilon=0.5)  # fmt: skip
    model = gpt(config, spec)
    norms = {name: module.eps for name, module in model.named_modules()
             if isinstance(getattr(module, "eps", None), float)}  # fmt: skip
    assert any(name.endswith("q_layernorm") for name in norms)
    assert set(norms.values()) == {1e-5}, norms


def test_where_megatrons_constructor_works_it_is_megatrons():
    """With the upstream fix (or TE installed) the probe says Megatron's own
    MultiLatentAttention.__init__ works, and NPUMLASelfAttention calls it; the model is the
    same. Here the fix is played by Megatron's module flag set to False in this test only."""
    from mcore_npu.transformer import mla

    config = mla_config()
    oracle = megatron_oracle(config)
    before = mla.megatron_mla_constructs()  # 0.16.1: False; 0.18+ (HAVE_TE False): True
    with megatron_mla_without_te():
        assert mla.megatron_mla_constructs()
        model = gpt(config, npu_block(config), seed=5)
    assert mla.megatron_mla_constructs() == before  # the flag is back
    model.load_state_dict(oracle.state_dict(), strict=True)
    got, want = logits_and_grads(model, False), logits_and_grads(oracle, False)
    assert max(_worst(got, want)) <= TOLERANCE


@pytest.mark.parametrize("rope_kernel", ["off", "reference"])
def test_recomputed_up_projections_change_nothing(rope_kernel):
    """recompute_modules=["mla_up_proj"]: Megatron's recompute of the up projections and RoPE
    (its path, and this module's with fused RoPE) gives the same logits and gradients."""
    plain, recompute = mla_config(), mla_config(recompute_granularity="selective",
                                                recompute_modules=["mla_up_proj"])  # fmt: skip
    want = gpt(plain, npu_block(plain, rope_kernel=rope_kernel), seed=5)
    model = gpt(recompute, npu_block(recompute, rope_kernel=rope_kernel), seed=5)
    assert model.decoder.layers[0].self_attention.recompute_up_proj
    model.load_state_dict(want.state_dict())
    got = logits_and_grads(model, False)
    assert max(_worst(got, logits_and_grads(want, False))) <= 1e-6


NAME_CASES = [(32, True, "RMSNorm", None), (None, True, "RMSNorm", None),
              (32, False, "RMSNorm", None), (32, True, "LayerNorm", None),
              (32, True, "RMSNorm", "moe"), (32, True, "RMSNorm", "deepseek")]  # fmt: skip
MOE = dict(num_moe_experts=2, moe_router_topk=2, moe_ffn_hidden_size=64, moe_layer_freq=[0, 1],
           moe_token_dispatcher_type="allgather")  # fmt: skip
MOE_CASES = {None: {}, "moe": MOE,  # DeepSeek-V3's: sigmoid router with expert bias, shared expert
             "deepseek": dict(MOE, moe_router_score_function="sigmoid",
                              moe_router_enable_expert_bias=True,
                              moe_shared_expert_intermediate_size=32)}  # fmt: skip


@pytest.mark.parametrize("q_lora_rank,qk,normalization,moe", NAME_CASES)
def test_te_layout_names_are_the_te_mla_specs(q_lora_rank, qk, normalization, moe):
    """Parameters, state_dict, sharded_state_dict and disk keys equal specs/param_names_te.yaml
    (Megatron's TE MLA spec; moe: a dense first layer, then an MoE layer, with DeepSeek-V3's
    expert bias and shared expert once); the local layout has the names of Megatron's own local
    MLA spec."""
    config = mla_config(q_lora_rank, qk_layernorm=qk, normalization=normalization,
                        **MOE_CASES[moe])  # fmt: skip
    model = gpt(config, npu_block(config, param_layout="te"))
    assert {n for n, _ in model.named_parameters()} == expected_names(config, "parameters")
    assert set(model.state_dict()) == expected_names(config, "state_dict")
    sharded = model.sharded_state_dict()
    assert set(sharded) == expected_names(config, "sharded")
    assert {value.key for value in sharded.values()} == {disk_key(n, config) for n in sharded}
    megatron = megatron_oracle(config)  # Megatron's local MLA spec (its own names)
    local = gpt(config, npu_block(config, param_layout="local"))
    assert set(local.state_dict()) == set(megatron.state_dict())
    assert set(local.sharded_state_dict()) == set(megatron.sharded_state_dict())


@pytest.mark.parametrize("saved, loaded", [("local", "te"), ("te", "local")])
def test_checkpoints_cross_layouts_and_resume_exactly(tmp_path, saved, loaded):
    """Real dist_checkpointing: every tensor lands bit for bit in the other layout, and the
    loaded model's logits, gradients and one Adam step equal the saved model's exactly."""
    from mcore_npu.training import checkpointing

    config = mla_config()
    source = gpt(config, npu_block(config, param_layout=saved), seed=1)
    target = gpt(config, npu_block(config, param_layout=loaded), seed=2)
    path = checkpointing.save({"model": source.sharded_state_dict()}, tmp_path, 1)
    state = checkpointing.match_layout(target.sharded_state_dict(), path)
    target.load_state_dict(checkpointing.load({"model": state}, path)["model"])
    results = []
    for model in (source, target):
        logits, _ = logits_and_grads(model, False)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        optimizer.step()
        results.append((logits, logits_and_grads(model, False)[0]))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


class ReferenceTorchNpu(types.ModuleType):
    """A stand-in torch_npu (no NPU here): the reference operator, recording each call's layout
    and q/k/v shapes. ``old=True`` answers Dv < D as op-plugin releases that allocate the output
    like the query do: D wide (zeros here)."""

    def __init__(self, old: bool = False):
        super().__init__("torch_npu")
        self.old, self.calls = old, []

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, **kwargs):
        self.calls.append((input_layout, *(tuple(t.shape) for t in (query, key, value))))
        result = reference.npu_fusion_attention(query, key, value, head_num, input_layout,
                                                **kwargs)  # fmt: skip
        if self.old and result[0].shape[-1] != query.shape[-1]:
            return (query.new_zeros(query.shape), *result[1:])
        return result


def _run_with(monkeypatch, stand_in, mode, packed=False):
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", stand_in)
    config = mla_config()
    model = gpt(config, npu_block(config, kernel="torch_npu", mla_value_padding=mode), seed=5)
    return logits_and_grads(model, packed)


@pytest.mark.parametrize("packed", [False, True], ids=["sbhd", "thd"])
def test_value_padding_switch_reaches_the_operator(monkeypatch, packed):
    """Through the stand-in torch_npu, forward (the backward runs autograd through the stand-in's
    reference): off gives SBH / TND calls with v at Dv = 12, on pads v to D = 24. Logits and gradients equal
    (the padded columns only ever hold zeros), and equal the reference kernel's model."""
    want = logits_and_grads(gpt(mla_config(), npu_block(mla_config()), seed=5), packed)
    seen = {}
    for mode in ("off", "on"):
        stand_in = ReferenceTorchNpu()
        got = _run_with(monkeypatch, stand_in, mode, packed)
        assert max(_worst(got, want)) <= 1e-6, mode
        seen[mode] = {call[3] for call in stand_in.calls if call[0] in ("SBH", "TND")}
    # v: SBH [16, 2, 4 heads * Dv] or TND [16, 4, Dv], Dv = 12 unpadded, 24 padded; megatron-core
    # 0.18+ pads v to D itself on THD (multi_latent_attention._prepare_mla_core_attention_value)
    from megatron.core.transformer import multi_latent_attention as megatron_mla

    megatron_pads_thd = hasattr(megatron_mla, "_prepare_mla_core_attention_value")
    assert {s[-1] for s in seen["off"]} == {(24 if megatron_pads_thd else 12) if packed else 48}
    assert {s[-1] for s in seen["on"]} == {24 if packed else 96}


def test_value_padding_auto_probes_the_installed_torch_npu(monkeypatch):
    """auto: a torch_npu that returns Dv-wide outputs gets unpadded calls, an older one (D wide)
    padded ones, each decided by one probe call; off on the older one fails with the fix."""
    new, old = ReferenceTorchNpu(), ReferenceTorchNpu(old=True)
    assert value_padding.takes_smaller_value(new.npu_fusion_attention, "cpu")
    assert not value_padding.takes_smaller_value(old.npu_fusion_attention, "cpu")
    for stand_in, width in ((ReferenceTorchNpu(), 48), (ReferenceTorchNpu(old=True), 96)):
        _run_with(monkeypatch, stand_in, "auto")
        probe, *calls = stand_in.calls
        assert probe == ("SBH", (1, 1, 16), (1, 1, 16), (1, 1, 8))  # once, before the first
        assert {call[3][-1] for call in calls} == {width}
    with pytest.raises(RuntimeError, match="mla_value_padding='auto' or 'on'"):
        _run_with(monkeypatch, ReferenceTorchNpu(old=True), "off")
    with pytest.raises(ValueError, match="mla_value_padding: unknown value 'yes'"):
        npu_block(mla_config(), mla_value_padding="yes")
