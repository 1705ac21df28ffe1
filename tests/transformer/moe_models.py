"""Tiny MoE GPTs for the MoE tests: the NPU spec, and Megatron's local MoE path (SequentialMLP)
with only the router swapped for ``NPUTopKRouter`` (Megatron's own router cannot run without TE
on megatron-core 0.16.1, see tests/transformer/test_router.py)."""

from __future__ import annotations

import copy

from tests.transformer.megatron_models import gpt, tiny_config


def moe_config(shared_expert: bool = False, dispatcher: str = "allgather", **overrides):
    fields = dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_token_dispatcher_type=dispatcher,
        moe_router_dtype="fp32",
        moe_aux_loss_coeff=1e-2,
        moe_router_load_balancing_type="aux_loss",
        moe_shared_expert_intermediate_size=48 if shared_expert else None,
    )
    fields.update(overrides)
    return tiny_config(**fields)


def local_moe_spec(config):
    """Megatron's local decoder-block spec (SequentialMLP) with NPUTopKRouter in MoE layers."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mcore_npu.transformer.router import NPUTopKRouter

    block = copy.deepcopy(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                     normalization=config.normalization))  # fmt: skip
    for layer in block.layer_specs:
        moe = layer.submodules.mlp.submodules
        if hasattr(moe, "router"):
            moe.router = NPUTopKRouter
    return block


def npu_moe_spec(config, **kwargs):
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    kwargs.setdefault("kernel", "reference")
    return get_gpt_decoder_block_npu_spec(config, normalization=config.normalization, **kwargs)


def twin_moe_models(config, **npu_kwargs):
    """(Megatron local MoE model, NPU-spec model) with the same weights."""
    local = gpt(config, local_moe_spec(config))
    npu = gpt(config, npu_moe_spec(config, **npu_kwargs), seed=7)
    state = local.state_dict()
    if npu_kwargs.get("param_layout") == "te":
        state = local_to_te_names(state)
    npu.load_state_dict(state, strict=True)
    return local, npu


def local_to_te_names(state: dict) -> dict:
    """``experts.local_experts.{e}.linear_fc1.weight`` -> ``experts.linear_fc1.weight{e}``."""
    renamed = {}
    for key, value in state.items():
        if ".experts.local_experts." in key:
            head, tail = key.split(".experts.local_experts.")
            e, which, leaf = tail.split(".")
            if leaf == "_extra_state":
                continue
            key = f"{head}.experts.{which}.{leaf}{e}"
        renamed[key] = value
    return renamed
