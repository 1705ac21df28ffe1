"""Transformer-layer specs for Megatron-Core whose core attention is ``NPUFusionAttention``.

Built from Megatron's own local spec, called with keywords only (its parameters drift between
releases), then these submodules are swapped (``NPUSpecProvider`` makes each):

- ``self_attention.submodules.core_attention`` -> ``NPUFusionAttention`` (with ``kernel`` and a
  cu_seqlens memo shared by every layer of the spec);
- the torch norms (input, pre-MLP, q/k, and the block's final norm) -> ``SequenceParallelNorm``,
  usable under sequence parallelism, whose RMSNorm is ``npu_rms_norm`` (``NPURMSNorm``);
- the dense ``MLP`` -> ``NPUMLP`` (SwiGLU through ``npu_swiglu``);
- in MoE layers, the router -> ``NPUTopKRouter`` (no Transformer Engine needed), the experts ->
  ``NPUGroupedMLP`` (one ``npu_grouped_matmul`` per projection), the shared experts ->
  ``NPUSharedExpertMLP``;
- ``SelfAttention`` -> ``NPUSelfAttention`` (its ``attention_output_gate`` computed eagerly, not
  through Megatron's ``torch.compile``'d function), or ``NPURotarySelfAttention`` with fused RoPE;
- the layer stays Megatron's ``TransformerLayer`` (so ``get_gpt_mtp_block_spec`` takes the spec);
  an MLP slot holding a subclass of Megatron's MLP / MoE classes becomes a ``BoundModuleSpec``
  that holds the process groups given as ``pg_collection=`` (none: parallel_state's), built
  without Megatron's "Unknown MLP type" warning (``mcore_npu/transformer/layer.py``);
- with ``multi_latent_attention=True``, Megatron's ``MLASelfAttention`` -> ``NPUMLASelfAttention``
  (``mcore_npu/transformer/mla.py``: buildable without Transformer Engine), its latent norms
  swapped like the other norms; ``mla_value_padding`` picks the padded or unpadded value.

The fused operators follow ``kernel`` unless ``rms_norm_kernel`` / ``swiglu_kernel`` /
``grouped_matmul_kernel`` say otherwise; ``"off"`` keeps Megatron's module for that part
(``torch.nn.RMSNorm``, ``MLP``, ``SequentialMLP``). The router is always swapped.

``param_layout`` picks the parameter names:

- ``"te"`` (the default): the names and ``sharded_state_dict`` keys of Megatron's Transformer
  Engine spec for the same arguments (``get_gpt_layer_with_transformer_engine_spec``, what
  Megatron-LM, MindSpeed and the Hugging Face bridges of verl use): the input norm of attention
  and of a dense MLP is fused into ``linear_qkv`` / ``linear_fc1`` (``NormColumnParallelLinear``,
  ``layer_norm_weight``), ``input_layernorm`` / ``pre_mlp_layernorm`` become ``IdentityOp``
  (an MoE layer keeps ``pre_mlp_layernorm``), and the slots where TE stores ``_extra_state``
  carry an empty one. Multi-latent attention as Megatron's TE MLA spec: ``input_layernorm`` stays,
  the latent norms go into ``linear_q_up_proj`` / ``linear_kv_up_proj`` (``layer_norm_weight``).
  The lists are in ``specs/param_names_te.yaml``.
- ``"local"``: the names of Megatron's local spec (``input_layernorm.weight``, ...).

The numbers are the same in both layouts, parameter for parameter. Nothing is patched; Megatron's
objects are deep-copied before anything is changed.

Usage::

    from megatron.core.models.gpt import GPTModel
    from mcore_npu import get_gpt_layer_npu_spec

    model = GPTModel(config, transformer_layer_spec=get_gpt_layer_npu_spec(qk_layernorm=True),
                     vocab_size=32000, max_sequence_length=4096)
"""

from __future__ import annotations

import copy
import functools
import inspect

from megatron.core.models.gpt import gpt_layer_specs as megatron_specs
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer import megatron_features
from mcore_npu.transformer.backends import PARAM_LAYOUTS, resolve_backend
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
from mcore_npu.transformer.spec_provider import NPUSpecProvider

_SPEC_KEYWORDS = ("kernel", "param_layout", "rms_norm_kernel", "swiglu_kernel",
                  "grouped_matmul_kernel", "rope_kernel", "moe_permute_kernel",
                  "mla_value_padding", "pg_collection")  # fmt: skip


def get_gpt_layer_npu_spec(
    *,
    kernel: str = "auto",
    param_layout: str = "te",
    rms_norm_kernel: str | None = None,
    swiglu_kernel: str | None = None,
    grouped_matmul_kernel: str | None = None,
    moe_permute_kernel: str | None = "off",
    rope_kernel: str | None = "off",
    mla_value_padding: str = "auto",
    pg_collection=None,
    **local_spec_kwargs,
) -> ModuleSpec:
    """Megatron's local GPT layer spec with ``NPUFusionAttention`` as core attention.

    Args:
        kernel: ``"auto"`` | ``"torch_npu"`` | ``"reference"`` (see ``mcore_npu.ops``).
        param_layout: ``"te"`` (Transformer Engine spec names) | ``"local"`` (local spec names).
        rms_norm_kernel, swiglu_kernel, grouped_matmul_kernel: a kernel for that fused
            operator, ``"off"`` for Megatron's own module, None (default) = ``kernel``.
        moe_permute_kernel: the fused MoE token permute (``NPUMoELayer``'s alltoall / allgather
            dispatchers); ``"off"`` (default) = Megatron's ``MoELayer``, None = ``kernel``.
        rope_kernel: fused RoPE (``npu_rotary_mul``, ``NPURotarySelfAttention``; with
            multi-latent attention on the rope slice of ``NPUMLASelfAttention``); ``"off"``
            (default) = Megatron's own RoPE, None = ``kernel``.
        mla_value_padding: ``"auto"`` | ``"on"`` | ``"off"``: multi-latent attention's value
            head (Dv < D) padded to D for the operator, or not (auto: where the installed
            torch_npu needs it; see ``mcore_npu.ops.value_padding``).
        pg_collection: the ``ProcessGroupCollection`` of a model built on process groups of its
            own (``GPTModel(..., pg_collection=...)``), handed to the NPU MLP / MoE modules as
            Megatron's layer hands them to its own classes; None (default): parallel_state's.
        **local_spec_kwargs: the keywords of the installed ``get_gpt_layer_local_spec``
            (``num_experts``, ``moe_grouped_gemm``, ``qk_layernorm``, ``normalization``,
            ``multi_latent_attention``, ...).

    Returns:
        A ``ModuleSpec`` for Megatron's ``TransformerLayer``, to pass as
        ``transformer_layer_spec`` (or to ``get_gpt_mtp_block_spec``). With
        ``sequence_parallel=True`` pass ``get_gpt_decoder_block_npu_spec(config)`` instead, so
        that the block's final norm supports it too.
    """
    _check_kernel(kernel)
    _check_layout(param_layout)
    _check_keywords(local_spec_kwargs, megatron_specs.get_gpt_layer_local_spec)
    provider = NPUSpecProvider(kernel=kernel, param_layout=param_layout,
                               rms_norm_kernel=rms_norm_kernel, swiglu_kernel=swiglu_kernel,
                               grouped_matmul_kernel=grouped_matmul_kernel,
                               moe_permute_kernel=moe_permute_kernel,
                               rope_kernel=rope_kernel,
                               mla_value_padding=mla_value_padding)  # fmt: skip
    spec = copy.deepcopy(megatron_specs.get_gpt_layer_local_spec(**local_spec_kwargs))
    grouped = bool(local_spec_kwargs.get("moe_grouped_gemm", False))
    return _swap_npu_parts(spec, provider, grouped, pg_collection)


def get_gpt_decoder_block_npu_spec(
    config,
    *,
    kernel: str = "auto",
    param_layout: str = "te",
    rms_norm_kernel: str | None = None,
    swiglu_kernel: str | None = None,
    grouped_matmul_kernel: str | None = None,
    moe_permute_kernel: str | None = "off",
    rope_kernel: str | None = "off",
    mla_value_padding: str = "auto",
    pg_collection=None,
    gdn_naive_l2norm: bool = False,
    moe_grouped_gemm: bool | None = None,
    **block_spec_kwargs,
):
    """Megatron's GPT decoder-block spec (dense and MoE layers as ``config`` says), NPU parts in.

    Mirrors ``get_gpt_decoder_block_spec(config, use_transformer_engine=False, ...)``: the same
    layer pattern (``moe_layer_freq``), pipeline-stage slicing and final norm, with every layer's
    core attention and every torch norm swapped as in ``get_gpt_layer_npu_spec``. With
    ``config.experimental_attention_variant="gated_delta_net"`` the layers that
    ``linear_attention_freq`` marks (Megatron's reading, at each layer's global position) get
    ``NPUGatedDeltaNet`` as ``self_attention`` (``mcore_npu/transformer/gated_delta_net``); the
    others keep the NPU attention.

    Args:
        config: Megatron ``TransformerConfig``.
        kernel, param_layout, rms_norm_kernel, swiglu_kernel, grouped_matmul_kernel,
            rope_kernel, moe_permute_kernel, mla_value_padding, pg_collection: as for
            ``get_gpt_layer_npu_spec`` (``config.multi_latent_attention`` builds MLA); with ``"te"``
            the final norm has ``TENorm``'s ``_extra_state`` too, so the key set is the TE block
            spec's.
        gdn_naive_l2norm: GDN layers l2-normalise q and k with plain torch before the rule
            (MindSpeed's ``use_naive_l2norm``) instead of inside it.
        moe_grouped_gemm: the routed experts' form, as the layer spec's keyword of the same
            name: None (default) = ``config.moe_grouped_gemm``; True = grouped experts
            (``TEGroupedMLP``'s names in the te layout) whatever the config says, what a weight
            bridge that maps only those names needs; False = sequential experts
            (``SequentialMLP``'s names). The computation is the same either way.
        **block_spec_kwargs: the installed ``get_gpt_decoder_block_spec`` keywords besides
            ``use_transformer_engine`` (``normalization``, ``qk_l2_norm``, ``vp_stage``,
            ``pp_rank``, ...).

    Returns:
        ``TransformerBlockSubmodules`` to pass as ``transformer_layer_spec``.
    """
    _check_kernel(kernel)
    _check_layout(param_layout)
    build = megatron_specs.get_gpt_decoder_block_spec
    _check_keywords(block_spec_kwargs, build, exclude=("config", "use_transformer_engine"))
    if moe_grouped_gemm is not None and not isinstance(moe_grouped_gemm, bool):
        raise TypeError(
            f"moe_grouped_gemm: expected True, False or None (the config's), got "
            f"{moe_grouped_gemm!r}"
        )
    if moe_grouped_gemm is None:
        moe_grouped_gemm = bool(getattr(config, "moe_grouped_gemm", False))
    block = copy.deepcopy(
        build(_builder_config(config, moe_grouped_gemm), use_transformer_engine=False,
              **block_spec_kwargs)
    )  # fmt: skip
    # one provider per model: every layer shares its cu_seqlens memo
    provider = NPUSpecProvider(kernel=kernel, param_layout=param_layout,
                               rms_norm_kernel=rms_norm_kernel, swiglu_kernel=swiglu_kernel,
                               grouped_matmul_kernel=grouped_matmul_kernel,
                               moe_permute_kernel=moe_permute_kernel,
                               rope_kernel=rope_kernel,
                               mla_value_padding=mla_value_padding)  # fmt: skip
    swapped: dict[int, ModuleSpec] = {}
    block.layer_specs = [
        swapped.setdefault(
            id(spec), _swap_npu_parts(spec, provider, moe_grouped_gemm, pg_collection)
        )
        for spec in block.layer_specs
    ]
    if is_gdn(config):
        block.layer_specs = hybrid_layer_specs(
            block.layer_specs, config, provider, vp_stage=block_spec_kwargs.get("vp_stage"),
            pp_rank=block_spec_kwargs.get("pp_rank"), naive_l2norm=gdn_naive_l2norm,
        )  # fmt: skip
    block.layer_norm = provider.layer_norm()
    return block


def _builder_config(config, moe_grouped_gemm: bool):
    """The config Megatron's block builder is given (``dense_block_config``), with the experts'
    form asked for: a shallow copy where it differs from ``config``'s (never written to)."""
    view = dense_block_config(config)
    if bool(getattr(view, "moe_grouped_gemm", False)) == moe_grouped_gemm:
        return view
    view = copy.copy(view)
    view.moe_grouped_gemm = moe_grouped_gemm
    return view


def get_gpt_mtp_block_npu_spec(
    config,
    block,
    *,
    kernel: str = "auto",
    param_layout: str = "te",
    rms_norm_kernel: str | None = None,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
):
    """Megatron's multi-token-prediction block spec for an NPU decoder block, or None.

    What ``get_gpt_mtp_block_spec(config, block, use_transformer_engine=...)`` builds, from the
    NPU spec provider (Megatron's ``get_gpt_mtp_block_spec_for_backend``): each of the
    ``config.mtp_num_layers`` MTP layers holds the block's last layer spec (its NPU attention,
    MLP / MoE parts), and its ``enorm`` / ``hnorm`` / ``final_layernorm`` and ``eh_proj`` are the
    provider's (``SequenceParallelNorm``, i.e. ``NPURMSNorm`` for RMSNorm;
    ``ColumnParallelLinear``): in ``param_layout="te"`` with TE's ``_extra_state`` entries, like
    the block's own norms. Pass the result to
    ``GPTModel(..., mtp_block_spec=...)``; without it a config with ``mtp_num_layers`` builds
    no MTP layers, and Megatron's ``GPTModel`` then splits the decoder output as if it had.

    Args:
        config: the Megatron ``TransformerConfig`` (``mtp_num_layers``; None / 0: no MTP).
        block: ``get_gpt_decoder_block_npu_spec(config, ...)`` (a ``TransformerBlockSubmodules``).
        kernel, param_layout, rms_norm_kernel: as for ``get_gpt_decoder_block_npu_spec``.
        vp_stage, pp_rank: this stage; MTP layers are built on the last pipeline stage only.

    Returns:
        ``MultiTokenPredictionBlockSubmodules``, or None (no MTP, or none on this stage).
    """
    _check_kernel(kernel)
    _check_layout(param_layout)
    if not getattr(config, "mtp_num_layers", None):
        return None
    provider = NPUSpecProvider(kernel=kernel, param_layout=param_layout,
                               rms_norm_kernel=rms_norm_kernel)  # fmt: skip
    return megatron_specs.get_gpt_mtp_block_spec_for_backend(
        config=config, spec=block, backend=provider, vp_stage=vp_stage, pp_rank=pp_rank
    )


def get_gpt_layer_spec(backend: str = "auto", **kwargs) -> ModuleSpec:
    """One place that picks a GPT layer spec.

    Args:
        backend: ``"npu_fusion"`` (this package), ``"local"`` (Megatron's local spec), ``"te"``
            (Transformer Engine), or ``"auto"``: npu_fusion when an NPU is present, else te when
            transformer-engine imports, else local.
        **kwargs: spec keywords; ``kernel``, ``param_layout`` and the fused-operator kernels only
            with npu_fusion (the te backend has the TE layout, the local backend the local one).
    """
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


def _swap_npu_parts(layer: ModuleSpec, provider: NPUSpecProvider, grouped: bool,
                    pg_collection=None) -> ModuleSpec:  # fmt: skip
    """Swap core attention, torch norms and the MLP / MoE parts inside one (already copied) layer
    spec for the provider's, then fuse the norms into the linears if its layout does, and bind
    the MLP slot (``pg_collection``'s groups) when it holds a subclass (``layer.py``)."""
    subs = layer.submodules
    attention = subs.self_attention.submodules
    attention.core_attention = provider.core_attention()
    module = subs.self_attention.module if isinstance(subs.self_attention, ModuleSpec) else None
    if module is SelfAttention:
        subs.self_attention = provider.self_attention(subs.self_attention)
    elif module is MLASelfAttention:
        subs.self_attention = provider.mla_self_attention(subs.self_attention)
    for owner, name in (
        (subs, "input_layernorm"),
        (subs, "pre_mlp_layernorm"),
        (attention, "q_layernorm"),
        (attention, "k_layernorm"),
        (attention, "kv_layernorm"),
    ):
        if _is_torch_norm(getattr(owner, name, None)):
            setattr(owner, name, provider.layer_norm())
    if provider.fuse_layernorm_and_linear():
        _fuse_norms(layer, provider)
    _swap_mlp(subs, provider, grouped)
    subs.mlp = bind_mlp_process_groups(subs.mlp, pg_collection)
    return layer


def _swap_mlp(subs, provider: NPUSpecProvider, grouped: bool) -> None:
    """Dense MLP -> NPUMLP; MoE router -> NPUTopKRouter, experts -> NPUGroupedMLP, shared
    experts -> NPUSharedExpertMLP (each unless its operator is "off"). A part left as it is keeps
    Megatron's own object (a ``functools.partial`` on megatron-core 0.17+, see ``_as_spec``)."""
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

        layer = ModuleSpec(module=NPURouterMoELayer, params=dict(mlp.params),
                           submodules=mlp.submodules)  # fmt: skip
    subs.mlp = _swapped(subs.mlp, mlp, layer)


def _as_spec(slot):
    """``slot`` as a ``ModuleSpec``: megatron-core 0.17+ builds its expert specs (0.18+ its MLP
    and MoE ones too) as ``functools.partial(cls, submodules=..., **params)`` (a dense MLP as
    ``partial(MLP.as_mlp_submodule, ...)``); those become ``ModuleSpec(cls, params,
    submodules)``. 0.19+ builds the shared experts through a function,
    ``partial(_build_shared_experts, submodules=...)`` (see :func:`_shared_experts_builder`):
    that becomes ``ModuleSpec(SharedExpertMLP, ...)``. Anything else is returned as it is."""
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
    """Whether ``slot`` is megatron-core 0.19+'s shared-experts builder: a function (not a
    class) taking exactly ``SharedExpertMLP``'s keywords (``config``, ``pg_collection``,
    ``gate``, ``submodules``), given its ``submodules``. It builds a ``SharedExpertMLP`` (or,
    with ``config.use_grouped_gemm_for_shared_expert``, TE's ``FusedSharedExpertMLP``, which
    ``NPUSharedExpertMLP`` refuses in one line). Read from the signature, not the version."""
    if isinstance(slot.func, type) or "submodules" not in slot.keywords:
        return False
    try:
        parameters = inspect.signature(slot.func).parameters
    except (TypeError, ValueError):
        return False
    return {"config", "pg_collection", "gate", "submodules"} <= set(parameters)


def _swapped(original, spec: ModuleSpec, new):
    """``new``, or ``original`` (Megatron's own object, partial or not) when the provider kept
    ``spec`` unchanged."""
    return original if new is spec else new


def _fuse_norms(layer: ModuleSpec, provider: NPUSpecProvider) -> None:
    """The TE spec's structure, as in Megatron 0.16.1's ``get_gpt_layer_with_transformer_engine_spec``
    (see specs/param_names_te.yaml): the input norm inside ``linear_qkv`` (MLA: the latent norms
    inside the up projections), a dense MLP built by ``get_mlp_module_spec_for_backend`` (its
    norm inside ``linear_fc1``), an MoE layer's ``pre_mlp_layernorm`` kept."""
    subs = layer.submodules
    if subs.self_attention.module is NPUMLASelfAttention:
        _fuse_latent_norms(subs.self_attention.submodules, provider)
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
    """Megatron 0.16.1's TE MLA spec (``get_gpt_layer_with_transformer_engine_spec``, MLA
    branch): a latent norm (``qk_layernorm``) moves into its up projection
    (``NormColumnParallelLinear``: ``layer_norm_weight``), the norm slot becomes ``IdentityOp``;
    without one the up projection stays a plain column-parallel linear. The down projections
    stay Megatron's ``ColumnParallelLinear`` (``MLASelfAttention`` accepts no other class
    without TE; the names are TE's, the tensors the same), ``input_layernorm`` stays."""
    for norm, up in (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj")):
        if getattr(attention, norm) is not IdentityOp:
            setattr(attention, up, provider.column_parallel_layer_norm_linear())
            setattr(attention, norm, IdentityOp)


def _is_torch_norm(module) -> bool:
    """Megatron's local norm: ``WrappedTorchNorm`` (possibly wrapped in a ModuleSpec)."""
    target = module.module if isinstance(module, ModuleSpec) else module
    return getattr(target, "__name__", "") == "WrappedTorchNorm"


def _check_layout(param_layout: str) -> None:
    if param_layout not in PARAM_LAYOUTS:
        raise ValueError(
            f"param_layout: unknown layout {param_layout!r}; pass one of {', '.join(PARAM_LAYOUTS)}"
        )


def _check_kernel(kernel: str) -> None:
    check_kernel(kernel)


def _check_keywords(kwargs: dict, function, exclude: tuple[str, ...] = ()) -> None:
    """Refuse keywords the installed Megatron function does not take, listing those it does."""
    parameters = inspect.signature(function).parameters  # 0.17+: copy_signature's
    accepted = [name for name in parameters if name not in exclude]
    unknown = [name for name in kwargs if name not in accepted]
    if unknown:
        raise TypeError(
            f"{unknown[0]}: not a keyword of the installed megatron-core's "
            f"{function.__name__}; it takes {', '.join(accepted)}"
        )
