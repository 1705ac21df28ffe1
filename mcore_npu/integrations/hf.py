"""Hugging Face checkpoints through mbridge, the bridge verl uses, into the NPU spec (TE layout).

mbridge maps Hugging Face names onto the names of Megatron's Transformer Engine spec
(``model.layers.{i}.input_layernorm.weight`` <-> ``decoder.layers.{i}.self_attention.linear_qkv.
layer_norm_weight``); the NPU spec in ``param_layout="te"`` has exactly those names, so the bridge's
own loaders and exporters work unchanged. What changes is the layer spec the bridge builds, on
the bridge instance (never on the mbridge module)::

    from mcore_npu.integrations.hf import npu_bridge, build_model

    bridge = npu_bridge("/path/to/Qwen2.5-0.5B", dtype=torch.bfloat16)   # AutoBridge + NPU spec
    model = build_model(bridge)                  # this pipeline stage's GPTModel
    bridge.load_weights([model], "/path/to/Qwen2.5-0.5B")
    for hf_name, tensor in bridge.export_weights([model]): ...           # back to HF names

MoE families load the same way (mbridge's Qwen3-MoE and Mixtral bridges set
``moe_grouped_gemm``, so the experts are ``NPUGroupedMLP`` with TEGroupedMLP's names
``mlp.experts.linear_fc1.weight{e}``, the names those bridges map). Per bridge instance,
``use_npu_spec`` also fills ``rope_theta`` and ``head_dim`` where transformers >= 5 leaves them
off the config, and matches the router's softmax form to the Hugging Face model's
(``match_hf_routing``). Bridges whose constructor cannot build their config on this stack
(``deepseek_v3``: ``mcore_npu.integrations.mbridge_fixes``; it also reads unquantised
DeepSeek-V3 checkpoints in any dtype, which mbridge's own reader cannot here) are built by
``bridge_from_config`` as the plugin's subclass of mbridge's class. Multi-token prediction:
mbridge 0.15.1 builds MTP layers from Transformer Engine's spec; for its MiMo bridge the plugin
builds them from the NPU spec instead (``install_npu_mtp_block``), every other bridge with MTP
layers is refused (``refuse_mbridge_mtp``). Qwen3.5 (dense, MoE, the hub's vision-language form)
and Qwen3-Next, for which mbridge has no bridge, go through the plugin's own
(``mcore_npu.integrations.hf_qwen3_5``, registered with mbridge's ``register_model``).

Or, for a model built elsewhere from ``get_gpt_decoder_block_npu_spec(param_layout="te")``,
``load_hf_weights(model, path)``. Needs ``pip install "mcore-npu[hf]"`` (mbridge, transformers,
safetensors); importing ``mcore_npu`` never imports this module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from mcore_npu.integrations.mbridge_fixes import PLUGIN_BRIDGES
from mcore_npu.transformer.layer_specs import (
    get_gpt_decoder_block_npu_spec,
    get_gpt_mtp_block_npu_spec,
)

logger = logging.getLogger(__name__)

# model_type -> (module, class) of the mbridge bridges whose MTP layers the plugin builds
NPU_MTP_BRIDGES = {"mimo": ("mbridge.models.mimo", "MimoBridge")}


def _auto_bridge():
    try:
        from mbridge import AutoBridge
    except ImportError as err:
        raise ImportError(
            f"mbridge: not importable ({err}); install the extra: pip install 'mcore-npu[hf]'"
        ) from err
    return AutoBridge


def use_npu_spec(bridge, *, kernel: str = "auto"):
    """Make ``bridge`` (an mbridge ``LLMBridge``) build the NPU decoder-block spec in TE layout.

    Overrides ``_get_transformer_layer_spec`` on this instance only; the spec follows
    ``bridge.config`` at build time, so ``bridge.set_extra_args(...)`` afterwards still applies.
    With ``bridge.config.mtp_num_layers`` set, a MiMo bridge gets its MTP block from the NPU spec
    (:func:`install_npu_mtp_block`); any other bridge raises ``ValueError`` when the model is
    built (:func:`refuse_mbridge_mtp`).

    Returns:
        ``bridge`` itself.
    """
    if not hasattr(bridge, "_get_transformer_layer_spec"):
        raise TypeError(
            f"bridge: {type(bridge).__name__} has no _get_transformer_layer_spec; pass an mbridge "
            "LLMBridge (AutoBridge.from_pretrained / from_config)"
        )

    def layer_spec(vp_stage=None):
        refuse_mbridge_mtp(bridge.config, bridge)  # its provider would add TE's MTP layers next
        return get_gpt_decoder_block_npu_spec(
            bridge.config,
            kernel=kernel,
            param_layout="te",
            normalization=bridge.config.normalization,
            vp_stage=vp_stage,
            **mbridge_expert_form(bridge.config),
        )

    bridge._get_transformer_layer_spec = layer_spec
    if builds_npu_mtp(bridge):
        install_npu_mtp_block(bridge, layer_spec, kernel=kernel)
    expose_hf_config_fields(bridge.hf_config)
    match_hf_routing(bridge)
    return bridge


def mbridge_expert_form(config) -> dict:
    """The spec keyword that gives an mbridge bridge experts it can map: ``{"moe_grouped_gemm":
    True}`` for an MoE config that asks for sequential experts (``moe_grouped_gemm=False``, one
    log line), else ``{}``.

    mbridge 0.15.1 maps only the grouped experts' names (``mlp.experts.linear_fc1.weight{e}``):
    its loader, its expert-parallel gather and its exporter all key on that name, and
    ``local_experts.{e}.linear_fc1.weight`` raises ``NotImplementedError: Unsupported parameter
    name``. The grouped experts compute the same function of the same weights
    (``NPUGroupedMLP``; sequential experts are the same module under ``SequentialMLP``'s names).
    """
    if not getattr(config, "num_moe_experts", None) or getattr(config, "moe_grouped_gemm", True):
        return {}
    logger.info(
        "moe_grouped_gemm=False: mbridge maps only grouped expert names "
        "(mlp.experts.linear_fc1.weight{e}), so the grouped experts are built instead "
        "(NPUGroupedMLP: the same computation of the same weights); Megatron-Bridge "
        "(vanilla_mbridge=False) and the plugin's own trainer build sequential experts"
    )
    return {"moe_grouped_gemm": True}


def bridge_from_config(hf_config, **bridge_kwargs):
    """mbridge's bridge for ``hf_config`` (``AutoBridge.from_config``), built so that its config
    builds on this stack: ``expose_hf_config_fields`` first (mbridge reads ``rope_theta`` while
    it constructs), and for the model types in ``mbridge_fixes.FIXED_BRIDGES`` the plugin's
    subclass of mbridge's class, whose config keywords are fixed (``deepseek_v3``: MLA's
    ``original_max_position_embeddings``, yarn, group-limited routing). ``bridge_kwargs``: the
    bridge constructor's (``dtype``, ...)."""
    from mcore_npu.integrations import mbridge_fixes

    expose_hf_config_fields(hf_config)
    if getattr(hf_config, "model_type", None) in PLUGIN_BRIDGES:
        from mcore_npu.integrations import hf_qwen3_5  # registers its bridge with mbridge

        return hf_qwen3_5.Qwen3_5Bridge(hf_config, **bridge_kwargs)
    if mbridge_fixes.needs_fixed_bridge(hf_config):
        return mbridge_fixes.fixed_bridge_class(hf_config.model_type)(hf_config, **bridge_kwargs)
    return _auto_bridge().from_config(hf_config, **bridge_kwargs)


def builds_npu_mtp(bridge) -> bool:
    """Whether the plugin builds ``bridge``'s MTP layers from the NPU spec: an mbridge bridge in
    :data:`NPU_MTP_BRIDGES` (MiMo), whose model comes from mbridge's ``LLMBridge`` provider
    (``_get_transformer_layer_spec`` then ``_get_gptmodel_args``)."""
    return _npu_mtp_base(bridge) is not None


def _npu_mtp_base(bridge):
    """The class after the MTP-building bridge class in ``bridge``'s MRO, or None."""
    import importlib

    mro = type(bridge).__mro__
    for module, name in NPU_MTP_BRIDGES.values():
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # pragma: no cover - another mbridge release
            continue
        if cls in mro:
            return mro[mro.index(cls) + 1]
    return None


def install_npu_mtp_block(bridge, layer_spec, *, kernel: str = "auto", **spec_keywords) -> None:
    """Give ``bridge`` (mbridge's MiMo bridge) MTP layers built from the NPU spec, on this
    instance only: its ``_get_gptmodel_args`` returns its parent class's arguments plus
    ``mtp_block_spec = get_gpt_mtp_block_npu_spec(bridge.config, layer_spec(), ...)`` while
    ``bridge.config.mtp_num_layers`` is set (each MTP layer is the decoder block's last layer
    spec; its norms the NPU spec's, in TE names).

    mbridge 0.15.1's ``MimoBridge._get_gptmodel_args`` (``mbridge/models/mimo.py``, lines 38-49)
    passes ``self.config``, a ``TransformerConfig``, to ``get_gpt_mtp_block_spec`` as the layer
    spec (``ValueError: Invalid spec`` on any machine) and asks for Transformer Engine's spec;
    its parent's arguments are the rest of what it returns. ``layer_spec(vp_stage=None)``: the
    bridge's decoder-block spec (the MTP layers are built on the last pipeline stage only;
    virtual pipeline stages are not passed). ``kernel`` / ``spec_keywords``: the NPU spec's
    (``rms_norm_kernel`` for the MTP norms).
    """
    base = _npu_mtp_base(bridge)
    if base is None:
        raise ValueError(
            f"bridge: {type(bridge).__name__} is not one whose MTP layers the plugin builds "
            f"(those: {', '.join(NPU_MTP_BRIDGES)})"
        )

    def gptmodel_args() -> dict:
        args = base._get_gptmodel_args(bridge)
        if getattr(bridge.config, "mtp_num_layers", None):
            args["mtp_block_spec"] = get_gpt_mtp_block_npu_spec(
                bridge.config, layer_spec(), kernel=kernel, param_layout="te",
                rms_norm_kernel=spec_keywords.get("rms_norm_kernel"),
            )  # fmt: skip
        return args

    bridge._get_gptmodel_args = gptmodel_args


def refuse_mbridge_mtp(config, bridge=None) -> None:
    """Refuse multi-token prediction on a bridge's config unless the plugin builds that bridge's
    MTP layers (:func:`builds_npu_mtp`: MiMo). mbridge 0.15.1 builds them from Transformer
    Engine's spec (``get_gpt_mtp_block_spec(..., use_transformer_engine=True)`` in its
    deepseek_v3 provider and mimo model arguments), which a machine without TE cannot build and
    the NPU spec does not reach.

    Raises:
        ValueError: ``config.mtp_num_layers`` is set (> 0) and ``bridge`` is not a MiMo bridge.
    """
    layers = getattr(config, "mtp_num_layers", None)
    if layers and not (bridge is not None and builds_npu_mtp(bridge)):
        raise ValueError(
            f"mtp_num_layers: {layers}; mbridge builds multi-token-prediction layers from "
            "Transformer Engine's spec, which the NPU spec replaces only for MiMo "
            f"({', '.join(NPU_MTP_BRIDGES)}). Turn MTP off (verl: "
            "actor_rollout_ref.model.mtp.enable=False; mbridge: "
            "bridge.set_extra_args(mtp_num_layers=None)), or build the model from "
            "get_gpt_decoder_block_npu_spec and get_gpt_mtp_block_npu_spec yourself"
        )


def expose_hf_config_fields(hf_config) -> None:
    """Write onto ``hf_config`` the fields mbridge 0.15.1 reads and transformers >= 5 leaves off:
    ``rope_theta`` (from ``rope_parameters``) and ``head_dim`` (where it is None). The values are
    the ones transformers itself uses, so the Hugging Face model does not change."""
    _expose_rope_theta(hf_config)
    _expose_head_dim(hf_config)


# Hugging Face MoE families whose router is softmax -> top-k -> (renormalise the k weights?):
# model_type -> whether the k weights are renormalised, from the HF config.
_SOFTMAX_TOP_K_RENORMALISED = {
    "mixtral": lambda hf_config: True,  # MixtralTopKRouter always divides by the top-k sum
    "qwen2_moe": lambda hf_config: bool(getattr(hf_config, "norm_topk_prob", False)),
    "qwen3_moe": lambda hf_config: bool(getattr(hf_config, "norm_topk_prob", False)),
    # Qwen3.5 MoE's router always divides by the top-k sum; Qwen3-Next's with norm_topk_prob
    "qwen3_5_moe": lambda hf_config: True,
    "qwen3_5_moe_text": lambda hf_config: True,
    "qwen3_next": lambda hf_config: bool(getattr(hf_config, "norm_topk_prob", True)),
}


def match_hf_routing(bridge) -> None:
    """Make the bridge's MoE router compute the Hugging Face model's expert weights.

    Megatron's softmax router has two forms (``moe_router_pre_softmax``): softmax over all
    experts then top-k (weights not renormalised), or top-k of the logits then softmax over the
    k (= the renormalised top-k of the full softmax; the experts chosen are the same). mbridge
    0.15.1 hard-codes one form per family: ``True`` for Mixtral, whose Hugging Face router
    always renormalises, and ``False`` for Qwen3-MoE, which renormalises only with
    ``norm_topk_prob``. This sets ``moe_router_pre_softmax = not renormalised`` through
    ``bridge.set_extra_args`` (this instance only) unless the caller set it already; families
    with another router (sigmoid, grouped top-k) are left alone.
    """
    pre_softmax = hf_router_pre_softmax(getattr(bridge, "hf_config", None))
    if pre_softmax is None or "moe_router_pre_softmax" in bridge.extra_args:
        return
    if bridge.config.moe_router_pre_softmax != pre_softmax:
        bridge.set_extra_args(moe_router_pre_softmax=pre_softmax)


def hf_router_pre_softmax(hf_config) -> bool | None:
    """Megatron's ``moe_router_pre_softmax`` that computes this Hugging Face model's expert
    weights (``not renormalised``, see :func:`match_hf_routing`), or None for a family without
    a softmax -> top-k router (dense models, sigmoid or grouped routers)."""
    renormalised = _SOFTMAX_TOP_K_RENORMALISED.get(getattr(hf_config, "model_type", None))
    return None if renormalised is None else not renormalised(hf_config)


def _expose_rope_theta(hf_config) -> None:
    """transformers >= 5 keeps ``rope_theta`` in ``rope_parameters``; mbridge 0.15.1 reads
    ``hf_config.rope_theta``. Copy it onto this bridge's config object (nothing else changes)."""
    if getattr(hf_config, "rope_theta", None) is not None:
        return
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" in parameters:
        hf_config.rope_theta = parameters["rope_theta"]


def _expose_head_dim(hf_config) -> None:
    """transformers >= 5 gives some configs (Mixtral) ``head_dim = None``, meaning
    ``hidden_size // num_attention_heads``; mbridge 0.15.1 multiplies ``hf_config.head_dim``
    when it merges q/k/v. Write the number the model uses onto this bridge's config object."""
    if getattr(hf_config, "head_dim", 0) is None:
        hf_config.head_dim = hf_config.hidden_size // hf_config.num_attention_heads


def npu_bridge(
    hf_path: str,
    *,
    kernel: str = "auto",
    dtype=torch.bfloat16,
    trust_remote_code: bool = False,
    **bridge_kwargs,
):
    """mbridge's bridge for the checkpoint at ``hf_path`` (as ``AutoBridge.from_pretrained(
    hf_path, dtype=dtype, ...)``, through :func:`bridge_from_config`) with the NPU spec."""
    from transformers import AutoConfig

    _auto_bridge()  # the install hint first, if mbridge is missing
    hf_config = AutoConfig.from_pretrained(hf_path, trust_remote_code=trust_remote_code)
    bridge = bridge_from_config(hf_config, dtype=dtype, **bridge_kwargs)
    return use_npu_spec(bridge, kernel=kernel)


def build_model(bridge, *, pre_process: bool | None = None, post_process: bool | None = None):
    """This pipeline stage's ``GPTModel`` from the bridge's own model provider, left where it was
    built (no ``.cuda()``, no DDP or mixed-precision wrapper: the caller's training code adds
    those), so it also works on a CPU. Megatron's parallel state must exist."""
    from megatron.core import parallel_state

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    provider = bridge._model_provider([])
    return provider(pre_process=pre_process, post_process=post_process)


def load_hf_weights(model, hf_path: str, *, bridge=None, kernel: str = "auto"):
    """Load the Hugging Face safetensors in ``hf_path`` into ``model`` (NPU spec, TE layout).

    Args:
        model: a ``GPTModel`` (or a list of virtual-pipeline chunks) whose names are the TE
            spec's, e.g. built by ``build_model`` or from ``get_gpt_decoder_block_npu_spec``.
        hf_path: a directory with ``config.json`` and ``*.safetensors``.
        bridge: an mbridge bridge to use; ``npu_bridge(hf_path)`` in the model's dtype if None.

    Returns:
        The bridge (reuse it for ``bridge.export_weights([model])``).
    """
    models = model if isinstance(model, list) else [model]
    if bridge is None:
        dtype = next(models[0].parameters()).dtype
        bridge = npu_bridge(hf_path, kernel=kernel, dtype=dtype)
    bridge.load_weights(models, hf_path)
    return bridge


def export_hf_weights(model, bridge) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hugging_face_name, tensor)`` for every weight of ``model``, through ``bridge``."""
    models = model if isinstance(model, list) else [model]
    yield from bridge.export_weights(models)
