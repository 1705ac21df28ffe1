"""A stand-in torch_npu (no NPU here; ``tests/fused_standin.py``: records every call, answers
with the reference) sees exactly the documented arguments when an MoE layer and a dense layer
of the NPU spec run forward and backward with the fused kernels set to ``torch_npu``."""

from __future__ import annotations

import pytest
import torch

from tests.fused_standin import install
from tests.transformer.megatron_models import batch, gpt
from tests.transformer.moe_models import moe_config, npu_moe_spec

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

FUSED_ON_STANDIN = dict(kernel="reference", rms_norm_kernel="torch_npu",
                        swiglu_kernel="torch_npu", grouped_matmul_kernel="torch_npu")  # fmt: skip


def _run(monkeypatch, config):
    model = gpt(config, npu_moe_spec(config, **FUSED_ON_STANDIN))
    standin = install(monkeypatch)
    ids, pos = batch(b=2, s=8)
    model(ids, pos, None).float().pow(2).mean().backward()
    return model, standin


def test_moe_and_dense_layers_call_the_three_operators_with_the_documented_arguments(
    monkeypatch,
):
    config = moe_config(moe_layer_freq=[1, 0], shared_expert=False)  # layer 0 MoE, layer 1 dense
    model, standin = _run(monkeypatch, config)
    eps = config.layernorm_epsilon
    norms = [c for c in standin.calls if c[0] == "npu_rms_norm"]
    # per layer: input, q, k, pre-MLP; plus the final norm
    assert len(norms) == 2 * 4 + 1
    for _, (x, gamma), kwargs in norms:
        assert kwargs == {"epsilon": eps}
        assert gamma.shape == (x.shape[-1],) and gamma.dtype == x.dtype
    swiglus = [c for c in standin.calls if c[0] == "npu_swiglu"]
    assert len(swiglus) == 2  # the experts' activation and the dense MLP's
    assert all(kwargs == {"dim": -1} for _, _, kwargs in swiglus)
    ffn = {x.shape[-1] for _, (x,), _ in swiglus}
    assert ffn == {2 * config.moe_ffn_hidden_size, 2 * config.ffn_hidden_size}
    gmm = [c for c in standin.calls if c[0] == "npu_grouped_matmul"]
    # fc1 and fc2: forward one call each, backward dX and dW one call each
    assert len(gmm) == 6
    kinds = sorted((k["split_item"], k["group_type"], k["group_list_type"]) for _, _, k in gmm)
    assert kinds == [(2, 0, 1)] * 4 + [(3, 2, 1)] * 2
    tokens = 2 * 8 * config.moe_router_topk
    for _, (x, weight), kwargs in gmm:
        assert set(kwargs) == {"group_list", "split_item", "group_type", "group_list_type"}
        assert kwargs["group_list"].dtype == torch.int64
        assert kwargs["group_list"].shape == (4,) and int(kwargs["group_list"].sum()) == tokens
        assert len(x) == 1
        assert len(weight) == (1 if kwargs["group_type"] == 2 else 4)


def test_shared_experts_use_npu_swiglu_too(monkeypatch):
    config = moe_config(moe_layer_freq=[1, 1], shared_expert=True)
    model, standin = _run(monkeypatch, config)
    assert type(model.decoder.layers[0].mlp.shared_experts).__name__ == "NPUSharedExpertMLP"
    widths = sorted(args[0].shape[-1] for name, args, _ in standin.calls if name == "npu_swiglu")
    shared = 2 * config.moe_shared_expert_intermediate_size
    assert widths == sorted([2 * config.moe_ffn_hidden_size] * 2 + [shared] * 2)


def test_off_leaves_megatrons_modules(monkeypatch):
    config = moe_config(moe_layer_freq=[1, 0])
    spec = npu_moe_spec(config, kernel="reference", rms_norm_kernel="off", swiglu_kernel="off",
                        grouped_matmul_kernel="off")  # fmt: skip
    model = gpt(config, spec)
    standin = install(monkeypatch)
    ids, pos = batch(b=2, s=8)
    model(ids, pos, None).sum().backward()
    assert standin.calls == []
    layers = model.decoder.layers
    assert type(layers[0].mlp.experts).__name__ == "SequentialMLP"
    assert type(layers[0].mlp.router).__name__ == "NPUTopKRouter"
    assert type(layers[1].mlp).__name__ == "MLP"
    assert type(layers[0].input_layernorm).__name__ == "RMSNorm"


def test_unknown_fused_kernel_is_refused():
    from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec

    with pytest.raises(ValueError, match="swiglu_kernel: unknown value 'npu'"):
        get_gpt_layer_npu_spec(swiglu_kernel="npu")
    with pytest.raises(ValueError, match="param_layout: unknown layout 'mcore'"):
        get_gpt_layer_npu_spec(param_layout="mcore")
