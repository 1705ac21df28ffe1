"""param_layout="te": the names of Megatron's TE spec (specs/param_names_te.yaml), the numbers of
the local layout. Real megatron-core models on one gloo process (fp32, CPU, reference kernel)."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.megatron_features import needs_fields
from tests.transformer.megatron_models import batch, gpt, tiny_config
from tests.transformer.moe_models import submodules_of
from tests.transformer.te_names import disk_key, expected_names

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

MOE = dict(num_moe_experts=2, moe_router_topk=2, moe_ffn_hidden_size=64,
           moe_token_dispatcher_type="allgather")  # fmt: skip


def _config(moe: bool, qk: bool, normalization: str, grouped: bool = False):
    extra = dict(MOE, moe_layer_freq=[0, 1], moe_grouped_gemm=grouped) if moe else {}
    return tiny_config(qk_layernorm=qk, normalization=normalization, **extra)


def _block(config, layout="te"):
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    return get_gpt_decoder_block_npu_spec(
        config, kernel="reference", param_layout=layout, normalization=config.normalization
    )


QK_NORM = list(itertools.product((False, True), ("RMSNorm", "LayerNorm")))
CASES = [(False, *c, False) for c in QK_NORM] + [
    (True, *c, g) for c in QK_NORM for g in (False, True)
]


@pytest.mark.parametrize("moe,qk,normalization,grouped", CASES)
def test_te_layout_names_are_the_te_specs(moe, qk, normalization, grouped):
    """Parameters, state_dict, sharded_state_dict and disk keys; grouped = moe_grouped_gemm
    (NPUGroupedMLP with TEGroupedMLP's names, sequential = SequentialMLP's)."""
    config = _config(moe, qk, normalization, grouped)
    model = gpt(config, _block(config))
    assert {n for n, _ in model.named_parameters()} == expected_names(config, "parameters")
    assert set(model.state_dict()) == expected_names(config, "state_dict")
    sharded = model.sharded_state_dict()
    assert set(sharded) == expected_names(config, "sharded")
    on_disk = {value.key for value in sharded.values()}
    assert on_disk == {disk_key(n, config) for n in sharded}


DEEPSEEK_MOE = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                    moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)  # fmt: skip


@needs_fields("moe_shared_expert_gate", feature="the MoE shared-expert gate")
@pytest.mark.parametrize("grouped", [False, True])
def test_deepseek_moe_layer_names_are_the_te_specs(grouped):
    """A dense first layer, then an MoE layer with the router's expert bias and gated shared
    experts: their names too (the same four sets as above)."""
    config = tiny_config(**MOE, **DEEPSEEK_MOE, moe_layer_freq=[0, 1], moe_grouped_gemm=grouped)
    model = gpt(config, _block(config))
    assert "decoder.layers.1.mlp.router.expert_bias" in model.state_dict()
    assert {n for n, _ in model.named_parameters()} == expected_names(config, "parameters")
    assert set(model.state_dict()) == expected_names(config, "state_dict")
    sharded = model.sharded_state_dict()
    assert set(sharded) == expected_names(config, "sharded")
    assert {value.key for value in sharded.values()} == {disk_key(n, config) for n in sharded}


def test_layer_spec_has_te_parameter_names():
    from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec, get_gpt_layer_spec

    config = _config(False, True, "RMSNorm")
    for spec in (
        get_gpt_layer_npu_spec(qk_layernorm=True, kernel="reference"),
        get_gpt_layer_spec("npu_fusion", qk_layernorm=True, kernel="reference"),
    ):
        model = gpt(config, spec)
        assert {n for n, _ in model.named_parameters()} == expected_names(config, "parameters")
        layers = {n for n in model.state_dict() if n.startswith("decoder.layers.")}
        assert layers == {n for n in expected_names(config, "state_dict") if ".layers." in n}


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_te_and_local_layouts_compute_the_same(normalization):
    from mcore_npu.transformer.param_layout import rename_state_dict

    config = _config(False, True, normalization)
    local = gpt(config, _block(config, "local"), seed=3)
    te = gpt(config, _block(config, "te"), seed=4)
    with torch.no_grad():  # give the norms non-trivial weights, so a dropped norm shows
        for name, p in local.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    te.load_state_dict(rename_state_dict(local.state_dict(), te.state_dict()), strict=True)
    ids, pos = batch()
    results = []
    for model in (local, te):
        model.zero_grad()
        logits = model(ids, pos, None)
        logits.pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((logits.detach(), rename_state_dict(grads, te.state_dict())))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=1e-6, msg=name)


def test_layouts_are_refused_when_unknown_or_not_mapped():
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec, get_gpt_layer_spec

    with pytest.raises(ValueError, match="param_layout: unknown layout 'tee'"):
        get_gpt_decoder_block_npu_spec(tiny_config(), param_layout="tee")
    with pytest.raises(TypeError, match="param_layout: only the npu_fusion backend"):
        get_gpt_layer_spec("local", param_layout="te")
    config = tiny_config(moe_grouped_gemm=True, moe_layer_freq=[0, 1], **MOE)
    # grouped GEMM in the te layout: TEGroupedMLP's names need the grouped matmul
    with pytest.raises(ValueError, match="grouped_matmul_kernel: 'off' with moe_grouped_gemm"):
        get_gpt_decoder_block_npu_spec(config, param_layout="te", grouped_matmul_kernel="off")
    spec = get_gpt_decoder_block_npu_spec(config, param_layout="te")
    experts = submodules_of(spec.layer_specs[1].submodules.mlp).experts
    assert experts.module.__name__ == "NPUGroupedMLP" and experts.params["param_layout"] == "te"


def test_rename_names_every_unmatched_tensor():
    from mcore_npu.transformer.param_layout import match_names

    source = ["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.extra.weight"]
    target = ["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
              "decoder.layers.0.self_attention.linear_qkv._extra_state",
              "decoder.layers.0.missing.weight"]  # fmt: skip
    with pytest.raises(ValueError) as err:
        match_names(source, target)
    assert "decoder.layers.0.missing.weight" in str(err.value)
    assert "decoder.layers.0.extra.weight" in str(err.value)
    assert match_names(source[:1], target[:2]) == {target[0]: source[0]}


def test_fused_norm_linear_tags_norm_params_for_sequence_parallel():
    from mcore_npu.transformer.norm_linear import NormColumnParallelLinear

    config = tiny_config(normalization="LayerNorm", sequence_parallel=False)
    layer = NormColumnParallelLinear(64, 32, config=config, init_method=torch.nn.init.zeros_,
                                     bias=False, gather_output=False, skip_bias_add=False,
                                     is_expert=False)  # fmt: skip
    assert {n for n, _ in layer.named_parameters()} == {
        "weight", "layer_norm_weight", "layer_norm_bias"}  # fmt: skip
    assert layer.layer_norm_weight.sequence_parallel is False
    x = torch.randn(5, 2, 64)
    out, bias = layer(x)
    want = torch.nn.functional.layer_norm(x, (64,), eps=config.layernorm_epsilon) @ layer.weight.T
    torch.testing.assert_close(out, want)
    assert bias is None
