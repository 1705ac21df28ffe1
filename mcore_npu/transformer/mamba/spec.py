"""The NPU spec of Megatron's hybrid stack: each layer kind of the pattern from the NPU spec.

``M`` is ``MambaLayer`` with :class:`NPUMambaMixer`; ``*`` the NPU attention layer with its MLP
left out; ``-`` the NPU dense MLP with its attention left out (Megatron's ``MLPLayer``); ``E`` the
NPU MoE layer with its attention left out. In the te layout the input norms sit inside the
projections (``mixer.in_proj.layer_norm_weight``, ``self_attention.linear_qkv.layer_norm_weight``,
``mlp.linear_fc1.layer_norm_weight``), as in Megatron's ``mamba_stack_spec``; ``G`` (0.17+) is
``NPUGatedDeltaNet``, ``D`` (0.18+) the NPU DSA layer, ``+`` (0.19) the NPU MLA layer
(``NPUDSASelfAttention``, MLP left out). See docs/mamba_layer.md."""

from __future__ import annotations

import copy
import dataclasses

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from mcore_npu.transformer.gated_delta_net.spec import gdn_attention_spec
from mcore_npu.transformer.layer_specs import npu_layer_spec
from mcore_npu.transformer.mamba.mixer import NPUMambaMixer, NPUMambaMixerSubmodules
from mcore_npu.transformer.mamba.stack import NPUHybridStack, StackSubmodules
from mcore_npu.transformer.spec_provider import NPUSpecOptions, NPUSpecProvider

ANY_EXPERT_COUNT = 8
"""What the MoE layer spec is built with when no ``num_experts`` is given: Megatron's builder
needs a positive count, and the layer reads the real one from the config (as Megatron's own
``mamba_stack_spec`` does)."""


def get_hybrid_stack_npu_spec(
    *, pg_collection=None, num_experts: int | None = None, moe_grouped_gemm: bool = True, **kwargs
) -> ModuleSpec:
    """The spec of the installed Megatron's hybrid stack, every slot it has from the NPU spec.

    Pass it as ``MambaModel(config, mamba_stack_spec=spec, ..., hybrid_override_pattern=...)``
    (megatron-core 0.15-0.17) or ``HybridModel(config, hybrid_stack_spec=spec, ...,
    hybrid_layer_pattern=...)`` (0.18+), with ``config.is_hybrid_model=True``.

    Args:
        pg_collection: as for ``get_gpt_layer_npu_spec``.
        num_experts, moe_grouped_gemm: the ``E`` layers' experts (the count is read from the
            config when the layer is built; grouped by default, as Megatron's hybrid spec).
        **kwargs: the ``NPUSpecOptions`` (``param_layout`` "te" only: Megatron's hybrid stack has
            only TE names) and ``get_gpt_layer_local_spec``'s keywords (``qk_layernorm``, ...).
    """
    options = NPUSpecOptions.take(kwargs)
    if options.param_layout != "te":
        raise ValueError(
            f"param_layout: {options.param_layout!r}; Megatron's hybrid stack exists only in the "
            "TE layout (mamba_stack_spec / hybrid_stack_spec), so its checkpoints have TE names: "
            "pass param_layout='te'"
        )
    if options.batch_invariant:
        raise ValueError(
            "batch_invariant: batch-invariant mode does not support the hybrid stack's Mamba "
            "layers (no batch-invariant kernel of the scan): use a GPT model, or turn the mode off"
        )
    provider = NPUSpecProvider(options)  # one per model: every layer shares its memo

    def layer(**more):
        return npu_layer_spec(provider, pg_collection=pg_collection, **kwargs, **more)

    experts = dict(num_experts=num_experts or ANY_EXPERT_COUNT, moe_grouped_gemm=moe_grouped_gemm)
    slots = {  # built only for the slots the installed stack has
        "mamba_layer": lambda: mamba_layer_spec(provider),
        "attention_layer": lambda: attention_only(layer()),
        "mlp_layer": lambda: mlp_only(layer(), MLPLayer),
        "moe_layer": lambda: mlp_only(layer(**experts)),
        "gdn_layer": lambda: _gdn_layer(layer(), provider),
        "mla_layer": lambda: attention_only(layer(multi_latent_attention=True)),
        "dsa_layer": lambda: attention_only(layer(multi_latent_attention=True, dsa=True)),
        "mtp_block_spec": lambda: mtp_block_spec(provider),
    }
    names = [field.name for field in dataclasses.fields(StackSubmodules) if field.name in slots]
    submodules = StackSubmodules(**{name: slots[name]() for name in names})
    return ModuleSpec(
        module=NPUHybridStack, submodules=submodules, params={"final_norm": provider.layer_norm()}
    )


def mtp_block_spec(provider) -> ModuleSpec:
    """The hybrid model's multi-token-prediction block (0.17+, a pattern with ``/``): the NPU
    norms and ``eh_proj``; Megatron builds each depth's layers as a nested stack from the same
    slots (``mtp_model_layer=None``)."""
    from megatron.core.transformer import multi_token_prediction as mtp

    norm = provider.layer_norm()
    layer = ModuleSpec(
        module=mtp.MultiTokenPredictionLayer,
        submodules=mtp.MultiTokenPredictionLayerSubmodules(
            enorm=norm,
            hnorm=norm,
            eh_proj=provider.column_parallel_linear(),
            mtp_model_layer=None,
            layer_norm=norm,
        ),
    )
    return ModuleSpec(
        module=mtp.MultiTokenPredictionBlock,
        submodules=mtp.MultiTokenPredictionBlockSubmodules(layer_specs=[layer]),
    )


def _gdn_layer(layer: ModuleSpec, provider) -> ModuleSpec:
    """``G``: the attention-only layer with ``NPUGatedDeltaNet`` as its ``self_attention``."""
    new = attention_only(layer)
    new.submodules.self_attention = gdn_attention_spec(provider)
    return new


def mamba_layer_spec(provider) -> ModuleSpec:
    """``MambaLayer`` with ``NPUMambaMixer``, the input norm inside ``in_proj`` (TE names)."""
    in_proj = provider.column_parallel_layer_norm_linear()
    mixer = ModuleSpec(
        module=NPUMambaMixer,
        params={"kernel": "reference" if provider.kernel == "reference" else "auto"},
        submodules=NPUMambaMixerSubmodules(in_proj=in_proj, out_proj=RowParallelLinear),
    )
    return ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=IdentityOp, mixer=mixer, mamba_bda=get_bias_dropout_add
        ),
    )


def attention_only(layer: ModuleSpec) -> ModuleSpec:
    """A copy of the NPU ``TransformerLayer`` spec without its MLP part (``*``)."""
    new = _copy(layer)
    subs = new.submodules
    subs.pre_mlp_layernorm, subs.mlp, subs.mlp_bda = IdentityOp, IdentityOp, IdentityFuncOp
    _drop_keys(subs, "pre_mlp_layernorm.")
    return new


def mlp_only(layer: ModuleSpec, module=TransformerLayer) -> ModuleSpec:
    """A copy of the NPU layer spec without its attention part, as ``module`` (``MLPLayer`` for
    ``-``, ``TransformerLayer`` for ``E``)."""
    new = _copy(layer)
    new.module = module
    subs = new.submodules
    subs.input_layernorm, subs.self_attention = IdentityOp, IdentityOp
    subs.self_attn_bda = IdentityFuncOp
    _drop_keys(subs, "input_layernorm.")
    return new


def _copy(layer: ModuleSpec) -> ModuleSpec:
    new = copy.copy(layer)
    new.submodules = copy.copy(layer.submodules)
    return new


def _drop_keys(subs, prefix: str) -> None:
    keys = dict(getattr(subs, "sharded_state_dict_keys_map", None) or {})
    keys.pop(prefix, None)
    subs.sharded_state_dict_keys_map = keys
