"""The fused MoE permute in the NPU spec (``moe_permute_kernel``), in one process (EP=1).

A tiny MoE GPT with ``moe_permute_kernel="reference"`` against the same model with ``"off"``
(Megatron's ``MoELayer`` and its unfused permute), same weights: logits and every gradient
bit-identical, for the alltoall and allgather dispatchers (EP=2 under torchrun:
tests/distributed/test_moe_permute_ep.py). A stand-in torch_npu (no NPU here;
``tests/fused_standin.py``) records the operator calls.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from tests.fused_standin import install
from tests.transformer.megatron_models import batch, gpt
from tests.transformer.moe_models import module_of, moe_config, npu_moe_spec

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]


def _megatrons_moe_layer() -> str:
    """The class the spec keeps for ``moe_permute_kernel='off'``: Megatron's ``MoELayer``, or on
    megatron-core 0.15 (no router slot) ``NPURouterMoELayer``, Megatron's layer with the router
    swapped (token_permute.py)."""
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    slots = {field.name for field in dataclasses.fields(MoESubmodules)}
    return "MoELayer" if "router" in slots else "NPURouterMoELayer"


MEGATRONS_MOE_LAYER = _megatrons_moe_layer()


def _logits_and_grads(config, **spec_kwargs):
    model = gpt(config, npu_moe_spec(config, **spec_kwargs))
    ids, pos = batch(b=2, s=16)
    logits = model(ids, pos, None)
    logits.float().pow(2).mean().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return model, logits.detach(), grads


def _assert_identical(got, want):
    _, got_logits, got_grads = got
    _, want_logits, want_grads = want
    assert torch.equal(got_logits, want_logits)
    assert set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():
        assert torch.equal(got_grads[name], grad), name
    assert any(".experts." in n and g.abs().sum() > 0 for n, g in got_grads.items())


@pytest.mark.parametrize("shared_expert", [False, True])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_fused_permute_layer_equals_megatrons_unfused_layer_bit_for_bit(dispatcher,
                                                                        shared_expert):  # fmt: skip
    config = moe_config(dispatcher=dispatcher, shared_expert=shared_expert)
    fused = _logits_and_grads(config, moe_permute_kernel="reference")
    unfused = _logits_and_grads(config, moe_permute_kernel="off")
    layer = fused[0].decoder.layers[0].mlp
    assert type(layer).__name__ == "NPUMoELayer"
    name = {"alltoall": "NPUAlltoAllTokenDispatcher", "allgather": "NPUAllGatherTokenDispatcher"}
    assert type(layer.token_dispatcher).__name__ == name[dispatcher]
    assert type(unfused[0].decoder.layers[0].mlp).__name__ == MEGATRONS_MOE_LAYER
    _assert_identical(fused, unfused)


def test_drop_and_pad_alltoall_equals_megatron():
    config = moe_config(dispatcher="alltoall", moe_expert_capacity_factor=1.0,
                        moe_pad_expert_input_to_capacity=True)  # fmt: skip
    fused = _logits_and_grads(config, moe_permute_kernel="reference")
    assert fused[0].decoder.layers[0].mlp.token_dispatcher.drop_and_pad
    _assert_identical(fused, _logits_and_grads(config, moe_permute_kernel="off"))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_standin_records_permute_and_unpermute_per_moe_layer(monkeypatch, dispatcher):
    config = moe_config(dispatcher=dispatcher)
    standin = install(monkeypatch)
    _, logits, _ = _logits_and_grads(config, moe_permute_kernel="torch_npu")
    names = [n for n in standin.names() if "moe_token" in n]
    layers = config.num_layers
    assert names == ["npu_moe_token_permute_with_routing_map",
                     "npu_moe_token_unpermute_with_routing_map"] * layers  # fmt: skip
    tokens_per_layer = 2 * 16
    for name, args, kwargs in standin.calls:
        if name == "npu_moe_token_permute_with_routing_map":
            tokens, routing_map = args
            assert tokens.shape == (tokens_per_layer, config.hidden_size)
            assert routing_map.dtype == torch.bool and routing_map.shape == (tokens_per_layer, 4)
            assert set(kwargs) == {"probs", "num_out_tokens", "drop_and_pad"}
            assert kwargs["drop_and_pad"] is False
            # alltoall permutes the probs with the tokens; allgather picks them itself
            assert (kwargs["probs"] is not None) == (dispatcher == "alltoall")
            assert int(kwargs["num_out_tokens"]) == tokens_per_layer * config.moe_router_topk
        elif name == "npu_moe_token_unpermute_with_routing_map":
            permuted, indices, shape = args
            assert permuted.shape == (tokens_per_layer * 2, config.hidden_size)
            assert indices.shape == (tokens_per_layer * 2,)
            assert tuple(shape) == (tokens_per_layer, config.hidden_size)
            assert kwargs["probs"] is None and kwargs["routing_map"].dtype == torch.bool
    _, want, _ = _logits_and_grads(config, moe_permute_kernel="off")
    assert torch.equal(logits, want)


def test_off_is_the_default_and_builds_megatrons_moe_layer(monkeypatch):
    config = moe_config()
    standin = install(monkeypatch)
    model, _, _ = _logits_and_grads(config)
    assert type(model.decoder.layers[0].mlp).__name__ == MEGATRONS_MOE_LAYER
    assert not any("moe_token" in n for n in standin.names())
    assert config.moe_permute_fusion is False  # the intent lives in the spec, never in config


def test_auto_without_the_operators_falls_back_to_the_reference_with_one_warning(monkeypatch):
    """NPU tensors are simulated for the permute operators' choice (their device reads as
    "npu"; the stand-in torch_npu lacks the routing-map operators): the registry's policy,
    the reference permute with one warning, and the results of Megatron's own permute."""
    from mcore_npu.ops import permute_dispatch

    config = moe_config(dispatcher="alltoall")
    want = _logits_and_grads(config, moe_permute_kernel="off")
    standin = install(monkeypatch, routing_map_ops=False)
    monkeypatch.setattr(permute_dispatch, "_device", lambda t: types.SimpleNamespace(type="npu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _logits_and_grads(config, kernel="reference", moe_permute_kernel="auto")
    fallback = [w for w in caught if "using the PyTorch reference on the NPU" in str(w.message)]
    assert [str(w.message).split(":")[0] for w in fallback] == [
        "moe_token_permute_with_routing_map",
        "moe_token_unpermute_with_routing_map",
    ]
    assert not any("moe_token" in n for n in standin.names())
    _assert_identical(got, want)


def test_bad_moe_permute_kernel_is_refused():
    config = moe_config()
    with pytest.raises(ValueError, match="moe_permute_kernel: unknown value 'fast'"):
        npu_moe_spec(config, moe_permute_kernel="fast")


def test_the_layer_spec_and_the_provider_take_the_keyword():
    from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec
    from mcore_npu.transformer.spec_provider import NPUSpecProvider

    spec = get_gpt_layer_npu_spec(kernel="reference", num_experts=4, moe_permute_kernel="auto")
    assert spec.submodules.mlp.module.__name__ == "NPUMoELayer"
    assert spec.submodules.mlp.params["permute_kernel"] == "auto"
    off = get_gpt_layer_npu_spec(kernel="reference", num_experts=4)
    assert module_of(off.submodules.mlp).__name__ == MEGATRONS_MOE_LAYER
    assert NPUSpecProvider(kernel="reference", moe_permute_kernel=None).fused["moe_permute"] == (
        "reference")  # fmt: skip
    assert NPUSpecProvider(kernel="reference").fused["moe_permute"] == "off"
    dense = get_gpt_layer_npu_spec(kernel="reference", moe_permute_kernel="reference")
    assert dense.submodules.mlp.module.__name__ == "NPUMLP"  # dense layers are untouched
