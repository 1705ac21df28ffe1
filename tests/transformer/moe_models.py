"""Tiny MoE GPTs for the MoE tests: the NPU spec, and Megatron's local MoE path (SequentialMLP)
with only the router swapped for ``NPUTopKRouter`` (Megatron's own router cannot run without TE
on megatron-core 0.16.1, see tests/transformer/test_router.py); with expert biases its experts'
``linear_fc2`` returns a copy of its output (``CopiedOutputRowParallelLinear``, same numbers)."""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch

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
        moe = submodules_of(layer.submodules.mlp)
        if hasattr(moe, "router"):
            moe.router = NPUTopKRouter
        elif hasattr(moe, "experts"):  # megatron-core 0.15: no slot, Megatron's layer + our router
            from mcore_npu.transformer.token_permute import NPURouterMoELayer

            layer.submodules.mlp.module = NPURouterMoELayer
        if config.add_bias_linear and hasattr(moe, "experts"):
            submodules_of(moe.experts).linear_fc2 = CopiedOutputRowParallelLinear
    return block


def submodules_of(slot):
    """A spec's ``submodules``: a ``ModuleSpec``'s field, or the ``submodules=`` keyword of the
    ``functools.partial`` megatron-core 0.18+ builds MLP / MoE / expert specs as."""
    if isinstance(slot, functools.partial):
        return slot.keywords.get("submodules")
    return slot.submodules


def module_of(slot):
    """The class a spec slot builds: a ``ModuleSpec``'s ``module``, or the class of the
    ``functools.partial`` megatron-core 0.18+ builds MLP / MoE / expert specs as (a dense MLP:
    ``partial(MLP.as_mlp_submodule, ...)``, whose class is the method's owner)."""
    if isinstance(slot, functools.partial):
        func = slot.func
        return getattr(func, "__self__", func)
    return slot.module


def _row_parallel_linear():
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    return RowParallelLinear


class CopiedOutputRowParallelLinear(_row_parallel_linear()):
    """Megatron's ``RowParallelLinear`` returning a copy of its output (same numbers, same
    parameters and names).

    megatron-core 0.16.1's ``SequentialMLP`` cannot run expert biases in one process: with
    expert-parallel and expert-TP size 1 the expert's ``linear_fc2`` returns the view that
    ``_ReduceFromModelParallelRegion`` hands back, and ``MLP.forward`` adds the probability-
    weighted bias to it in place (``output += output_bias * per_token_scale``), which autograd
    refuses ("a view ... is being modified inplace"). The copy lets Megatron's own forward run.
    """

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return output.clone(), bias


def npu_moe_spec(config, **kwargs):
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    kwargs.setdefault("kernel", "reference")
    kwargs.setdefault("param_layout", "local")
    return get_gpt_decoder_block_npu_spec(config, normalization=config.normalization, **kwargs)


def twin_moe_models(config, **npu_kwargs):
    """(Megatron local MoE model, NPU-spec model, {local name: NPU name}) with the same weights.

    With ``config.moe_grouped_gemm`` the NPU experts carry TEGroupedMLP's names in the te layout;
    Megatron's local twin is then built without grouped GEMM (SequentialMLP, the same numbers).
    With ``add_bias_linear`` the local twin's biases (zero when built, as Megatron's linears
    start) are drawn from N(0, 0.1) first, so that a wrong bias cannot go unnoticed.
    """
    from mcore_npu.transformer.param_layout import match_names

    local_config = dataclasses.replace(config, moe_grouped_gemm=False)
    local = gpt(local_config, local_moe_spec(local_config))
    if config.add_bias_linear:
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, param in local.named_parameters():
                if name.endswith(".bias"):
                    param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    npu = gpt(config, npu_moe_spec(config, **npu_kwargs), seed=7)
    names = {name: name for name in local.state_dict()}
    if config.moe_grouped_gemm:
        names = local_to_te_names(names)
    if npu_kwargs.get("param_layout") == "te":
        by_target = match_names(names.values(), npu.state_dict().keys())
        renamed = {source: target for target, source in by_target.items()}
        names = {local_name: renamed[name] for local_name, name in names.items() if name in renamed}
    state = {names[name]: value for name, value in local.state_dict().items() if name in names}
    npu.load_state_dict(state, strict=True)
    return local, npu, names


def local_to_te_names(names: dict) -> dict:
    """Values ``experts.local_experts.{e}.linear_fc1.weight`` -> ``experts.linear_fc1.weight{e}``
    (their per-expert ``_extra_state`` entries dropped: TEGroupedMLP keeps one per linear)."""
    renamed = {}
    for key, name in names.items():
        if ".experts.local_experts." in name:
            head, tail = name.split(".experts.local_experts.")
            e, which, leaf = tail.split(".")
            if leaf == "_extra_state":
                continue
            name = f"{head}.experts.{which}.{leaf}{e}"
        renamed[key] = name
    return renamed
