"""A tiny MoE GPT (4 experts, top-2) from the NPU spec against Megatron's local MoE path
(SequentialMLP, same router): logits and every gradient within 1e-5 in fp32, on CPU.

The NPU spec runs NPUTopKRouter, NPUGroupedMLP (grouped matmul reference, swiglu reference),
NPURMSNorm, NPUMLP and NPUFusionAttention; the local model runs Megatron's modules with only
the router swapped (megatron-core 0.16.1's own router needs TE, see test_router.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.megatron_features import needs_fields
from tests.transformer.megatron_models import batch
from tests.transformer.moe_models import moe_config, twin_moe_models

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]


def _logits_and_grads(model, ids, pos):
    model.zero_grad()
    logits = model(ids, pos, None)
    logits.float().pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


@pytest.mark.parametrize("shared_expert", [False, True])
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@pytest.mark.parametrize(
    "param_layout,grouped_gemm", [("local", False), ("te", False), ("te", True)]
)
def test_npu_spec_moe_matches_megatrons_sequential_mlp(
    shared_expert, dispatcher, param_layout, grouped_gemm
):
    config = moe_config(shared_expert=shared_expert, dispatcher=dispatcher,
                        moe_grouped_gemm=grouped_gemm)  # fmt: skip
    local, npu, names = twin_moe_models(config, param_layout=param_layout)
    experts = npu.decoder.layers[0].mlp.experts
    assert type(experts).__name__ == "NPUGroupedMLP"
    assert type(local.decoder.layers[0].mlp.experts).__name__ == "SequentialMLP"
    ids, pos = batch(b=2, s=16)
    want, want_grads = _logits_and_grads(local, ids, pos)
    got, got_grads = _logits_and_grads(npu, ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert {names[n] for n in want_grads} == set(got_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[names[name]], grad, rtol=1e-5, atol=1e-5, msg=name)
    assert any(".experts." in n and g.abs().sum() > 0 for n, g in got_grads.items())


def test_te_layout_with_grouped_gemm_has_transformer_engines_grouped_names():
    config = moe_config(moe_grouped_gemm=True)
    _, npu, _ = twin_moe_models(config, param_layout="te")
    names = [n for n, _ in npu.decoder.layers[0].mlp.experts.named_parameters()]
    assert names == [f"linear_fc1.weight{e}" for e in range(4)] + [
        f"linear_fc2.weight{e}" for e in range(4)
    ]


def test_te_layout_without_grouped_gemm_keeps_sequential_names():
    _, npu, _ = twin_moe_models(moe_config(), param_layout="te")
    names = [n for n, _ in npu.decoder.layers[0].mlp.experts.named_parameters()]
    assert names[0] == "local_experts.0.linear_fc1.weight"
    assert type(npu.decoder.layers[0].mlp.experts).__name__ == "NPUGroupedMLP"


def test_moe_gpt_from_the_npu_spec_trains_on_cpu():
    config = moe_config(shared_expert=True)
    _, npu, _ = twin_moe_models(config)
    opt = torch.optim.Adam(npu.parameters(), lr=1e-2)
    ids, pos = batch(b=4, s=16, seed=3)
    labels = torch.roll(ids, -1, dims=1)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = npu(ids, pos, None, labels=labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


DEEPSEEK_MOE = dict(  # the DeepSeek-V3 MoE layer, scaled down: 8 experts, 2 groups of 4, 1 of
    # them, top-2 (Megatron's group score, the best topk // group_topk = 2, is the Hugging Face one)
    num_moe_experts=8, moe_router_topk=2, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5, moe_shared_expert_gate=True, moe_layer_freq=[0, 1],
    moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
)  # fmt: skip
EXPERT_BIAS = torch.tensor([0.2, -0.3, 0.0, 0.1, -0.1, 0.3, 0.05, -0.2])


@pytest.mark.parametrize(
    "param_layout,grouped_gemm,dispatcher",
    [("local", False, "allgather"), ("te", True, "alltoall")],
)
@needs_fields("moe_shared_expert_gate", feature="the MoE shared-expert gate")
def test_deepseek_moe_layers_match_megatrons(param_layout, grouped_gemm, dispatcher):
    """A dense first layer (``moe_layer_freq=[0, 1]``), then the DeepSeek-V3 MoE layer: sigmoid
    router with a (non-zero) expert bias, group-limited top-k, top-k scaling, gated shared
    experts. Logits and every gradient equal Megatron's MoE layer (SequentialMLP)."""
    config = moe_config(shared_expert=True, dispatcher=dispatcher, moe_grouped_gemm=grouped_gemm,
                        **DEEPSEEK_MOE)  # fmt: skip
    local, npu, names = twin_moe_models(config, param_layout=param_layout)
    dense, moe = npu.decoder.layers
    assert type(dense.mlp).__name__ == "NPUMLP" and type(moe.mlp.router).__name__ == "NPUTopKRouter"
    assert type(moe.mlp.shared_experts).__name__ == "NPUSharedExpertMLP"
    assert moe.mlp.shared_experts.use_shared_expert_gate
    if grouped_gemm:
        assert "decoder.layers.1.mlp.experts.linear_fc1.weight7" in npu.state_dict()
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in npu.state_dict()
    for model in (local, npu):
        model.decoder.layers[1].mlp.router.expert_bias.copy_(EXPERT_BIAS)
    ids, pos = batch(b=2, s=16)
    want, want_grads = _logits_and_grads(local, ids, pos)
    got, got_grads = _logits_and_grads(npu, ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert {names[n] for n in want_grads} == set(got_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[names[name]], grad, rtol=1e-5, atol=1e-5, msg=name)
    assert got_grads["decoder.layers.1.mlp.shared_experts.gate_weight"].abs().sum() > 0
    moe.mlp.router.expert_bias.zero_()  # the bias steers the choice: without it, other logits
    assert (_logits_and_grads(npu, ids, pos)[0] - got).abs().max() > 1e-4


def test_shared_experts_overlapped_with_the_dispatcher_run_npu_swiglu(monkeypatch):
    """``moe_shared_expert_overlap`` (what mbridge's DeepSeek-V3 bridge sets): Megatron's MoE
    layer calls the shared experts' ``linear_fc1_forward_and_act`` instead of their forward;
    NPUSharedExpertMLP's runs SwiGLU through ``mcore_npu.ops.swiglu`` there too (counted by a
    spy on the module's operator; Megatron's own step would call its ``torch.compile``'d
    ``bias_swiglu_impl`` under ``bias_activation_fusion``). Logits and gradients equal the
    path without overlap."""
    from mcore_npu.transformer import mlp

    calls = []
    real = mlp.swiglu
    monkeypatch.setattr(mlp, "swiglu", lambda *a, **k: calls.append(1) or real(*a, **k))
    results = []
    for overlap in (False, True):
        config = moe_config(shared_expert=True, dispatcher="alltoall", bias_activation_fusion=True,
                            moe_shared_expert_overlap=overlap)  # fmt: skip
        _, npu, _ = twin_moe_models(config)
        assert type(npu.decoder.layers[0].mlp.shared_experts).__name__ == "NPUSharedExpertMLP"
        calls.clear()
        results.append((_logits_and_grads(npu, *batch(b=2, s=16)), len(calls)))
    ((want, want_grads), plain_calls), ((got, got_grads), overlap_calls) = results
    assert overlap_calls == plain_calls == 2  # the shared expert of each of the 2 layers
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=1e-6, msg=name)
