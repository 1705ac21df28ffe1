"""GPT layer, decoder-block and MTP-block specs whose core attention is ``NPUFusionAttention``.

Megatron's own local spec is built (keywords only), deep-copied, and its attention, norms, MLP / MoE
parts and self-attention classes swapped for ``NPUSpecProvider``'s; an operator kernel ``"off"``
keeps Megatron's module for that part. The layer stays Megatron's ``TransformerLayer`` (an MLP
subclass bound to ``pg_collection``, ``layer.py``). ``param_layout="te"`` gives the names of
Megatron's TE spec (``specs/param_names_te.yaml``), ``"local"`` the local spec's. Nothing is
patched. See docs/specs.md."""

from __future__ import annotations

import copy
import difflib
import functools
import inspect

from megatron.core.models.gpt import gpt_layer_specs as megatron_specs
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_npu.transformer import megatron_features
from mcore_npu.transformer.backends import resolve_backend
from mcore_npu.transformer.batch_invariant import KERNEL as BATCH_INVARIANT_KERNEL
from mcore_npu.transformer.batch_invariant import route_linears
from mcore_npu.transformer.dsa import NPUDSASelfAttention, is_dsa
from mcore_npu.transformer.gated_delta_net.spec import (
    dense_block_config,
    hybrid_layer_specs,
    is_gdn,
)
from mcore_npu.transformer.layer import bind_mlp_process_groups
from mcore_npu.transformer.mla import NPUMLASelfAttention
from mcore_npu.transformer.rope import NPURotarySelfAttention
from mcore_npu.transformer.router import NPUTopKRouter
from mcore_npu.transformer.self_attention import NPUSelfAttention
from mcore_npu.transformer.spec_provider import OPTION_NAMES, NPUSpecOptions, NPUSpecProvider

_SPEC_KEYWORDS = (*OPTION_NAMES, "pg_collection")


def get_gpt_layer_npu_spec(*, pg_collection=None, **kwargs) -> ModuleSpec:
    """Megatron's local GPT layer spec with ``NPUFusionAttention`` as core attention.

    Args:
        pg_collection: the ``ProcessGroupCollection`` of a model with process groups of its own;
            None: parallel_state's.
        **kwargs: the :class:`NPUSpecOptions` (``kernel``, ``param_layout``, the operators'
            kernels, ``mla_value_padding``) and the installed ``get_gpt_layer_local_spec``'s.

    Returns:
        A ``ModuleSpec`` for ``TransformerLayer``. With ``sequence_parallel=True`` use
        ``get_gpt_decoder_block_npu_spec(config)``, whose final norm supports it.
    """
    provider = NPUSpecProvider(NPUSpecOptions.take(kwargs))
    return npu_layer_spec(provider, pg_collection=pg_collection, **kwargs)


def npu_layer_spec(
    provider: NPUSpecProvider, *, pg_collection=None, dsa: bool = False, **kwargs
) -> ModuleSpec:
    """Megatron's local layer spec for ``kwargs`` (``get_gpt_layer_local_spec``'s keywords)
    swapped by ``provider``, which a model's layers share; ``dsa``: MLA made DSA."""
    _check_keywords(kwargs, megatron_specs.get_gpt_layer_local_spec)
    spec = copy.deepcopy(megatron_specs.get_gpt_layer_local_spec(**kwargs))
    grouped = bool(kwargs.get("moe_grouped_gemm", False))
    return _swap_npu_parts(spec, provider, grouped, pg_collection, dsa)


def get_gpt_decoder_block_npu_spec(
    config,
    *,
    pg_collection=None,
    gdn_naive_l2norm: bool = False,
    moe_grouped_gemm: bool | None = None,
    **kwargs,
):
    """Megatron's GPT decoder-block spec (``use_transformer_engine=False``), each layer swapped as
    in ``get_gpt_layer_npu_spec``; with ``experimental_attention_variant="gated_delta_net"`` the
    layers ``linear_attention_freq`` marks get ``NPUGatedDeltaNet``.

    Args:
        pg_collection: as for :func:`get_gpt_layer_npu_spec`.
        gdn_naive_l2norm: GDN layers l2-normalise q and k in plain torch (MindSpeed's
            ``use_naive_l2norm``).
        moe_grouped_gemm: None = ``config.moe_grouped_gemm``; True / False = grouped / sequential
            experts' names whatever the config says.
        **kwargs: the :class:`NPUSpecOptions` and the installed ``get_gpt_decoder_block_spec``'s
            keywords.

    Returns:
        ``TransformerBlockSubmodules`` to pass as ``transformer_layer_spec``.
    """
    options = NPUSpecOptions.take(kwargs)
    build = megatron_specs.get_gpt_decoder_block_spec
    _check_keywords(kwargs, build, exclude=("config", "use_transformer_engine"))
    if moe_grouped_gemm is not None and not isinstance(moe_grouped_gemm, bool):
        raise TypeError(
            f"moe_grouped_gemm: expected True, False or None (the config's), got "
            f"{moe_grouped_gemm!r}"
        )
    if moe_grouped_gemm is None:
        moe_grouped_gemm = bool(getattr(config, "moe_grouped_gemm", False))
    block = copy.deepcopy(
        build(
            _builder_config(config, moe_grouped_gemm),
            use_transformer_engine=False,
            **kwargs,
        )
    )
    provider = NPUSpecProvider(options)  # one per model: every layer shares its memo
    swapped: dict[int, ModuleSpec] = {}
    swap = functools.partial(
        _swap_npu_parts, provider=provider, grouped=moe_grouped_gemm,
        pg_collection=pg_collection, dsa=is_dsa(config),
    )  # fmt: skip
    for spec in block.layer_specs:  # layers may share one spec object: swap it once
        if id(spec) not in swapped:
            swapped[id(spec)] = swap(spec)
    block.layer_specs = [swapped[id(spec)] for spec in block.layer_specs]
    if is_gdn(config):
        if provider.batch_invariant:
            raise ValueError(
                "batch-invariant mode does not support Gated DeltaNet layers (no batch-invariant "
                "kernel of the delta rule): use a model without linear attention, or turn the "
                "mode off"
            )
        block.layer_specs = hybrid_layer_specs(
            block.layer_specs,
            config,
            provider,
            vp_stage=kwargs.get("vp_stage"),
            pp_rank=kwargs.get("pp_rank"),
            naive_l2norm=gdn_naive_l2norm,
        )
    block.layer_norm = provider.layer_norm()
    return block


def _builder_config(config, moe_grouped_gemm: bool):
    """``dense_block_config(config)`` with the experts' form asked for (a shallow copy if it
    differs); DSA's MLA layers are built as MLA (0.16.1's dispatch refuses ``"dsa"``) and made
    DSA by :func:`_swap_npu_parts`."""
    view = dense_block_config(config)
    if is_dsa(view):
        view = copy.copy(view)
        view.experimental_attention_variant = None
    if bool(getattr(view, "moe_grouped_gemm", False)) == moe_grouped_gemm:
        return view
    view = copy.copy(view)
    view.moe_grouped_gemm = moe_grouped_gemm
    return view


def get_gpt_mtp_block_npu_spec(
    config, block, *, vp_stage: int | None = None, pp_rank: int | None = None, **options
):
    """Megatron's multi-token-prediction block spec for ``block`` (an NPU decoder block) from the
    NPU spec provider, for ``GPTModel(..., mtp_block_spec=...)``; None without MTP or off the last
    pipeline stage. ``options``: the :class:`NPUSpecOptions` (``kernel``, ``param_layout``,
    ``rms_norm_kernel``, ...) of the block."""
    provider = NPUSpecProvider(NPUSpecOptions(**options))
    if not getattr(config, "mtp_num_layers", None):
        return None
    _check_mtp_stage(config, block, vp_stage, pp_rank)
    spec = megatron_specs.get_gpt_mtp_block_spec_for_backend(
        config=config, spec=block, backend=provider, vp_stage=vp_stage, pp_rank=pp_rank
    )
    if provider.batch_invariant:  # the MTP layers' own linears (eh_proj) too
        return route_linears(spec, BATCH_INVARIANT_KERNEL[provider.kernel])
    return spec


def _check_mtp_stage(config, block, vp_stage, pp_rank) -> None:
    """ValueError where this stage builds MTP layers but no decoder layer: Megatron copies the
    last decoder layer's spec for them (an empty block would raise IndexError there)."""
    from megatron.core.transformer.multi_token_prediction import get_mtp_num_layers_to_build

    empty = getattr(block, "layer_specs", None) == []
    if empty and get_mtp_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank):
        raise ValueError(
            "pipeline layout: the stage with the MTP layers has no decoder layer, whose spec "
            "they copy; give the last stage at least one decoder layer, or turn MTP off "
            "(mtp_num_layers=None)"
        )


def get_gpt_layer_spec(backend: str = "auto", **kwargs) -> ModuleSpec:
    """A GPT layer spec for ``backend``: ``"npu_fusion"``, ``"local"``, ``"te"``, or ``"auto"``.

    ``auto`` is npu_fusion on an NPU, else te where transformer-engine imports, else local. The NPU
    keywords (``kernel``, ``param_layout``, the operator kernels) only go with npu_fusion."""
    backend = resolve_backend(backend)
    if backend == "npu_fusion":
        return get_gpt_layer_npu_spec(**kwargs)
    for name in _SPEC_KEYWORDS:
        if name in kwargs:
            raise TypeError(
                f"{name}: only the npu_fusion backend takes {name} (backend={backend!r})"
            )
    if backend == "te":
        build = megatron_specs.get_gpt_layer_with_transformer_engine_spec
    else:
        build = megatron_specs.get_gpt_layer_local_spec
    _check_keywords(kwargs, build)
    return build(**kwargs)


def _swap_npu_parts(
    layer: ModuleSpec, provider: NPUSpecProvider, grouped: bool, pg_collection=None,
    dsa: bool = False,
) -> ModuleSpec:  # fmt: skip
    """Swap core attention, torch norms and MLP / MoE parts of one (copied) layer spec (MLA ->
    DSA with ``dsa``), fuse the norms in the te layout, and bind the MLP slot to
    ``pg_collection``."""
    subs = layer.submodules
    attention = subs.self_attention.submodules
    attention.core_attention = provider.core_attention()
    module = subs.self_attention.module if isinstance(subs.self_attention, ModuleSpec) else None
    if module is SelfAttention:
        subs.self_attention = provider.self_attention(subs.self_attention)
    elif module is MLASelfAttention and dsa:
        subs.self_attention = provider.dsa_self_attention(subs.self_attention)
    elif module is MLASelfAttention:
        subs.self_attention = provider.mla_self_attention(subs.self_attention)
    attention = subs.self_attention.submodules  # DSA's is a copy
    latent = provider.latent_norm_epsilon() if module is MLASelfAttention else None
    for owner, name, epsilon in (
        (subs, "input_layernorm", None),
        (subs, "pre_mlp_layernorm", None),
        (attention, "q_layernorm", latent),
        (attention, "k_layernorm", None),
        (attention, "kv_layernorm", latent),
    ):
        if _is_torch_norm(getattr(owner, name, None)):
            setattr(owner, name, provider.layer_norm(epsilon=epsilon))
    if provider.fuse_layernorm_and_linear():
        _fuse_norms(layer, provider)
    _swap_mlp(subs, provider, grouped)
    subs.mlp = bind_mlp_process_groups(subs.mlp, pg_collection)
    if provider.batch_invariant:  # every matmul of the layer batch-invariant
        return route_linears(layer, BATCH_INVARIANT_KERNEL[provider.kernel])
    return layer


def _swap_mlp(subs, provider: NPUSpecProvider, grouped: bool) -> None:
    """Dense MLP, MoE router, experts and shared experts -> the NPU ones (unless "off")."""
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    mlp = _as_spec(subs.mlp)
    if not isinstance(mlp, ModuleSpec):
        return
    if mlp.module is MLP:
        subs.mlp = _swapped(subs.mlp, mlp, provider.dense_mlp(mlp))
        return
    moe = mlp.submodules
    if not hasattr(moe, "experts"):
        return
    if megatron_features.has("router_slot"):  # megatron-core >= 0.16
        moe.router = NPUTopKRouter
    shared = _as_spec(moe.shared_experts)
    if isinstance(shared, ModuleSpec) and shared.module is SharedExpertMLP:
        moe.shared_experts = _swapped(moe.shared_experts, shared, provider.shared_experts(shared))
    experts = _as_spec(moe.experts)
    if isinstance(experts, ModuleSpec):
        moe.experts = _swapped(moe.experts, experts, provider.experts(experts, grouped))
    layer = provider.moe_layer(mlp)  # NPUMoELayer unless "off"
    if layer is mlp and not megatron_features.has("router_slot"):  # megatron-core 0.15
        from mcore_npu.transformer.token_permute import NPURouterMoELayer

        layer = ModuleSpec(
            module=NPURouterMoELayer, params=dict(mlp.params), submodules=mlp.submodules
        )
    subs.mlp = _swapped(subs.mlp, mlp, layer)


def _as_spec(slot):
    """``slot`` as a ``ModuleSpec``: megatron-core 0.17+ builds some specs as
    ``functools.partial(cls, submodules=..., **params)`` (0.19+ the shared experts through a
    builder function); anything else is returned as it is."""
    if not isinstance(slot, functools.partial) or slot.args:
        return slot
    func = slot.func
    owner = getattr(func, "__self__", None)
    module = owner if getattr(func, "__name__", "") == "as_mlp_submodule" else func
    if _shared_experts_builder(slot):
        from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

        module = SharedExpertMLP
    if not isinstance(module, type):
        return slot
    params = dict(slot.keywords)
    return ModuleSpec(module=module, params=params, submodules=params.pop("submodules", None))


def _shared_experts_builder(slot: functools.partial) -> bool:
    """Whether ``slot`` is megatron-core 0.19+'s shared-experts builder (read from its signature)."""
    if isinstance(slot.func, type) or "submodules" not in slot.keywords:
        return False
    try:
        parameters = inspect.signature(slot.func).parameters
    except (TypeError, ValueError):
        return False
    return {"config", "pg_collection", "gate", "submodules"} <= set(parameters)


def _swapped(original, spec: ModuleSpec, new):
    """``new``, or ``original`` when the provider kept ``spec`` unchanged."""
    return original if new is spec else new


def _fuse_norms(layer: ModuleSpec, provider: NPUSpecProvider) -> None:
    """The TE spec's structure (``specs/param_names_te.yaml``): the input norm inside ``linear_qkv``
    (MLA: the latent norms inside the up projections), a dense MLP's norm inside ``linear_fc1``."""
    subs = layer.submodules
    if subs.self_attention.module is NPUMLASelfAttention:
        _fuse_latent_norms(subs.self_attention.submodules, provider)
    elif subs.self_attention.module is NPUDSASelfAttention:
        pass  # the indexer reads the normalised q latent: the latent norms stay (as in 0.19)
    elif subs.self_attention.module in (SelfAttention, NPUSelfAttention, NPURotarySelfAttention):
        subs.self_attention.submodules.linear_qkv = provider.column_parallel_layer_norm_linear()
        subs.input_layernorm = IdentityOp
    else:
        raise ValueError(
            f"param_layout='te': {subs.self_attention.module.__name__} layers are not mapped to "
            "the TE names (only SelfAttention and MLASelfAttention are); pass "
            "param_layout='local'"
        )
    if getattr(_as_spec(subs.mlp), "module", None) is MLP:
        subs.mlp = megatron_specs.get_mlp_module_spec_for_backend(
            backend=provider, num_experts=None
        )
        subs.pre_mlp_layernorm = IdentityOp
    subs.sharded_state_dict_keys_map = {}  # the local spec's map renames to what is now real


def _fuse_latent_norms(attention, provider: NPUSpecProvider) -> None:
    """Megatron's TE MLA spec: each latent norm moves into its up projection
    (``layer_norm_weight``)."""
    epsilon = provider.latent_norm_epsilon()
    for norm, up in (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj")):
        if getattr(attention, norm) is not IdentityOp:
            setattr(attention, up, provider.column_parallel_layer_norm_linear(epsilon))
            setattr(attention, norm, IdentityOp)


def _is_torch_norm(module) -> bool:
    """Megatron's local norm: ``WrappedTorchNorm`` (possibly in a ModuleSpec)."""
    target = module.module if isinstance(module, ModuleSpec) else module
    return getattr(target, "__name__", "") == "WrappedTorchNorm"


def _check_keywords(kwargs: dict, function, exclude: tuple[str, ...] = ()) -> None:
    """Refuse keywords the installed Megatron function does not take, listing those it does (and
    the closest of them or of the NPU spec's own)."""
    parameters = inspect.signature(function).parameters  # 0.17+: copy_signature's
    accepted = [name for name in parameters if name not in exclude]
    unknown = [name for name in kwargs if name not in accepted]
    if unknown:
        close = difflib.get_close_matches(unknown[0], [*accepted, *OPTION_NAMES], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TypeError(
            f"{unknown[0]}: not a keyword of the installed megatron-core's "
            f"{function.__name__}; it takes {', '.join(accepted)}{hint}"
        )
