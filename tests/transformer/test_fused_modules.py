"""NPURMSNorm and NPUMLP against Megatron's / torch's modules (same weights, fp32, CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.transformer.megatron_models import tiny_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_npu_rms_norm_equals_torch_rms_norm_and_is_tagged_for_sp(sequence_parallel):
    from mcore_npu.transformer.norms import NPURMSNorm, SequenceParallelNorm

    config = SimpleNamespace(sequence_parallel=sequence_parallel, normalization="RMSNorm",
                             layernorm_zero_centered_gamma=False)  # the fields norms read  # fmt: skip
    ours = SequenceParallelNorm(config, 64, eps=1e-5, kernel="reference")
    theirs = SequenceParallelNorm(config, 64, eps=1e-5)
    assert isinstance(ours, NPURMSNorm) and isinstance(theirs, torch.nn.RMSNorm)
    assert ours.weight.sequence_parallel is sequence_parallel
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(5, 2, 64, requires_grad=True)
    x2 = x.detach().requires_grad_()
    torch.testing.assert_close(ours(x), theirs(x2), rtol=1e-6, atol=1e-6)
    ours(x).pow(2).sum().backward()
    theirs(x2).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-5)


def _mlps(**overrides):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP

    from mcore_npu.transformer.mlp import NPUMLP

    config = tiny_config(**overrides)
    from tests.transformer.moe_models import submodules_of

    submodules = submodules_of(get_gpt_layer_local_spec().submodules.mlp)
    torch.manual_seed(0)
    theirs = MLP(config, submodules, ffn_hidden_size=config.ffn_hidden_size)
    ours = NPUMLP(config, submodules, kernel="reference")
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


@pytest.mark.parametrize("bias, fusion", [(False, False), (True, False), (True, True)])
def test_npu_mlp_equals_megatrons_mlp_with_bias_and_bias_activation_fusion(bias, fusion):
    ours, theirs = _mlps(add_bias_linear=bias, bias_activation_fusion=fusion)
    if bias:
        with torch.no_grad():
            theirs.linear_fc1.bias.uniform_(-1, 1)
            ours.linear_fc1.bias.copy_(theirs.linear_fc1.bias)
    x = torch.randn(6, 2, 64)
    (y1, b1), (y2, b2) = ours(x), theirs(x)
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
    assert (b1 is None) == (b2 is None)


def test_npu_mlp_leaves_other_activations_to_megatron(monkeypatch):
    from tests.fused_standin import install

    ours, theirs = _mlps(gated_linear_unit=False, activation_func=F.gelu)
    ours.kernel = "torch_npu"
    standin = install(monkeypatch)
    x = torch.randn(4, 2, 64)
    torch.testing.assert_close(ours(x)[0], theirs(x)[0], rtol=0, atol=0)
    assert standin.calls == []
