"""Hugging Face checkpoints through mbridge, the bridge verl uses, into the NPU spec (TE layout).

mbridge maps Hugging Face names onto the names of Megatron's TE spec, which the NPU spec has in
``param_layout="te"``, so the bridge's own loaders and exporters work unchanged; only the layer
spec the bridge builds changes, on the bridge instance (mbridge is not patched)::

    bridge = npu_bridge("/path/to/Qwen2.5-0.5B", dtype=torch.bfloat16)   # AutoBridge + NPU spec
    model = build_model(bridge)                  # this pipeline stage's GPTModel
    bridge.load_weights([model], "/path/to/Qwen2.5-0.5B")

:func:`use_npu_spec` also fixes the Hugging Face config fields transformers >= 5 leaves off and
the router's softmax form. DeepSeek-V3 gets the plugin's subclass (:mod:`.mbridge_fixes`),
Qwen3.5 / Qwen3-Next and Nemotron-H the plugin's own bridges (:mod:`.hf_qwen3_5`,
:mod:`.hf_nemotron_h`), GLM-5 / DeepSeek-V3.2 (DeepSeek Sparse Attention) :mod:`.hf_dsa`.
Needs ``mcore-npu[hf]``; ``import mcore_npu`` never imports this module. See docs/hf_weights.md.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mcore_npu.integrations.mbridge_fixes import PLUGIN_BRIDGES, mbridge_expert_form
from mcore_npu.transformer.layer_specs import (
    get_gpt_decoder_block_npu_spec,
    get_gpt_mtp_block_npu_spec,
)

# model_type -> (module, class) of the mbridge bridges whose MTP layers the plugin builds
NPU_MTP_BRIDGES = {"mimo": ("mbridge.models.mimo", "MimoBridge")}
# MLA checkpoints whose q / kv latent RMSNorms transformers (and the DeepSeek remote code) build
# at eps 1e-6 whatever rms_norm_eps says (DeepseekV3RMSNorm(q_lora_rank); Moonlight: 1e-5)
LATENT_NORM_EPS_1E6 = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def checkpoint_spec_keywords(hf_config) -> dict:
    """The NPU spec keywords a checkpoint's architecture fixes beyond its config fields:
    ``mla_latent_norm_epsilon=1e-6`` for :data:`LATENT_NORM_EPS_1E6`; else none."""
    if getattr(hf_config, "model_type", None) in LATENT_NORM_EPS_1E6:
        return {"mla_latent_norm_epsilon": 1e-6}
    return {}


def _auto_bridge():
    try:
        from mbridge import AutoBridge
    except ImportError as err:
        raise ImportError(
            f"mbridge: not importable ({err}); install the extra: pip install 'mcore-npu[hf]'"
        ) from err
    return AutoBridge


def use_npu_spec(bridge, *, kernel: str = "auto"):
    """Make ``bridge`` (an mbridge ``LLMBridge``) build the NPU decoder-block spec in TE layout;
    returns ``bridge``.

    Overrides ``_get_transformer_layer_spec`` on this instance only; the spec follows
    ``bridge.config`` at build time, so a later ``bridge.set_extra_args(...)`` still applies.
    MTP layers: from the NPU spec for MiMo, else refused (:func:`refuse_mbridge_mtp`). A bridge
    that builds its own NPU spec (``own_npu_spec``: Nemotron-H, Qwen3-VL, DSA) gets ``kernel``.
    """
    if getattr(bridge, "own_npu_spec", False):
        bridge.npu_kernel = kernel
        expose_hf_config_fields(bridge.hf_config)
        return bridge
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
            **checkpoint_spec_keywords(bridge.hf_config),
        )

    bridge._get_transformer_layer_spec = layer_spec
    if builds_npu_mtp(bridge):
        install_npu_mtp_block(bridge, layer_spec, kernel=kernel)
    expose_hf_config_fields(bridge.hf_config)
    match_hf_routing(bridge)
    return bridge


def bridge_from_config(hf_config, **bridge_kwargs):
    """The bridge for ``hf_config`` (as ``AutoBridge.from_config(hf_config, **bridge_kwargs)``),
    with the config fields exposed first; the plugin's bridge for ``PLUGIN_BRIDGES`` and
    ``mbridge_fixes.FIXED_BRIDGES``."""
    from mcore_npu.integrations import mbridge_fixes

    expose_hf_config_fields(hf_config)
    model_type = getattr(hf_config, "model_type", None)
    if model_type in mbridge_fixes.NEMOTRON_H_TYPES:
        from mcore_npu.integrations import hf_nemotron_h  # registers its bridge with mbridge

        return hf_nemotron_h.NemotronHBridge(hf_config, **bridge_kwargs)
    if model_type in mbridge_fixes.DSA_TYPES:
        from mcore_npu.integrations import hf_dsa  # registers its bridge with mbridge

        return hf_dsa.DSABridge(hf_config, **bridge_kwargs)
    if model_type in mbridge_fixes.QWEN3_VL_TYPES:
        from mcore_npu.integrations import hf_qwen3_vl_bridge  # registers its bridge with mbridge

        return hf_qwen3_vl_bridge.Qwen3VLBridge(hf_config, **bridge_kwargs)
    if model_type in PLUGIN_BRIDGES:
        from mcore_npu.integrations import hf_qwen3_5, hf_qwen3_5_vl  # register their bridges

        if hf_qwen3_5.is_hub_form(hf_config):  # the vision tower too
            return hf_qwen3_5_vl.Qwen3_5VLBridge(hf_config, **bridge_kwargs)
        return hf_qwen3_5.Qwen3_5Bridge(hf_config, **bridge_kwargs)
    if mbridge_fixes.needs_fixed_bridge(hf_config):
        return mbridge_fixes.fixed_bridge_class(hf_config.model_type)(hf_config, **bridge_kwargs)
    return _auto_bridge().from_config(hf_config, **bridge_kwargs)


def builds_npu_mtp(bridge) -> bool:
    """Whether the plugin builds ``bridge``'s MTP layers from the NPU spec: MiMo
    (:data:`NPU_MTP_BRIDGES`), and bridges that build them themselves (``npu_mtp``: GLM-5,
    DeepSeek-V3.2)."""
    return bool(getattr(bridge, "npu_mtp", False)) or _npu_mtp_base(bridge) is not None


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
    """Give ``bridge`` (mbridge's MiMo bridge) MTP layers from the NPU spec, on this instance
    only: its ``_get_gptmodel_args`` returns its parent class's arguments plus
    ``mtp_block_spec`` while ``bridge.config.mtp_num_layers`` is set.

    mbridge 0.15.1's ``MimoBridge._get_gptmodel_args`` passes a ``TransformerConfig`` as the
    layer spec (``ValueError: Invalid spec``) and asks for TE's spec. ``layer_spec()``: the
    bridge's decoder-block spec; ``spec_keywords``: the NPU spec's (``rms_norm_kernel``).
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
            norm = spec_keywords.get("rms_norm_kernel")
            args["mtp_block_spec"] = get_gpt_mtp_block_npu_spec(
                bridge.config, layer_spec(), kernel=kernel, param_layout="te", rms_norm_kernel=norm
            )
        return args

    bridge._get_gptmodel_args = gptmodel_args


def refuse_mbridge_mtp(config, bridge=None) -> None:
    """Raise ``ValueError`` when ``config.mtp_num_layers`` is set and the plugin does not build
    ``bridge``'s MTP layers (:func:`builds_npu_mtp`): mbridge builds them from TE's spec."""
    layers = getattr(config, "mtp_num_layers", None)
    if layers and not (bridge is not None and builds_npu_mtp(bridge)):
        raise ValueError(
            f"mtp_num_layers: {layers}; mbridge builds multi-token-prediction layers from "
            "Transformer Engine's spec, which the NPU spec replaces only for MiMo "
            f"({', '.join(NPU_MTP_BRIDGES)}), GLM-5 and DeepSeek-V3.2. Turn MTP off (verl: "
            "actor_rollout_ref.model.mtp.enable=False; mbridge: "
            "bridge.set_extra_args(mtp_num_layers=None)), or build the model from "
            "get_gpt_decoder_block_npu_spec and get_gpt_mtp_block_npu_spec yourself"
        )


def expose_hf_config_fields(hf_config) -> None:
    """Write onto ``hf_config`` the fields mbridge 0.15.1 reads and transformers >= 5 leaves off
    (``rope_theta``, ``head_dim``), with the values transformers itself uses."""
    _expose_rope_theta(hf_config)
    _expose_head_dim(hf_config)


# model_type of a softmax -> top-k router -> whether it renormalises the k weights
_SOFTMAX_TOP_K_RENORMALISED = {
    "mixtral": lambda hf_config: True,
    "qwen2_moe": lambda hf_config: bool(getattr(hf_config, "norm_topk_prob", False)),
    "qwen3_moe": lambda hf_config: bool(getattr(hf_config, "norm_topk_prob", False)),
    "qwen3_5_moe": lambda hf_config: True,
    "qwen3_5_moe_text": lambda hf_config: True,
    "qwen3_next": lambda hf_config: bool(getattr(hf_config, "norm_topk_prob", True)),
}


def match_hf_routing(bridge) -> None:
    """Make the bridge's MoE router compute the Hugging Face model's expert weights.

    Megatron's softmax router either takes softmax then top-k (not renormalised) or top-k then
    softmax over the k (renormalised); mbridge 0.15.1 hard-codes one form per family. This sets
    ``moe_router_pre_softmax = not renormalised`` through ``bridge.set_extra_args`` unless the
    caller set it; other routers (sigmoid, grouped top-k) are left alone.
    """
    pre_softmax = hf_router_pre_softmax(getattr(bridge, "hf_config", None))
    if pre_softmax is None or "moe_router_pre_softmax" in bridge.extra_args:
        return
    if bridge.config.moe_router_pre_softmax != pre_softmax:
        bridge.set_extra_args(moe_router_pre_softmax=pre_softmax)


def hf_router_pre_softmax(hf_config) -> bool | None:
    """Megatron's ``moe_router_pre_softmax`` for this Hugging Face model's router, or None
    without a softmax -> top-k router (dense models, sigmoid or grouped routers)."""
    renormalised = _SOFTMAX_TOP_K_RENORMALISED.get(getattr(hf_config, "model_type", None))
    return None if renormalised is None else not renormalised(hf_config)


def _expose_rope_theta(hf_config) -> None:
    """Copy ``rope_parameters["rope_theta"]`` to ``hf_config.rope_theta`` (mbridge reads it)."""
    if getattr(hf_config, "rope_theta", None) is not None:
        return
    parameters = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" in parameters:
        hf_config.rope_theta = parameters["rope_theta"]


def _expose_head_dim(hf_config) -> None:
    """Replace ``head_dim = None`` (Mixtral, transformers >= 5) by the number the model uses:
    mbridge multiplies by it when it merges q/k/v."""
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
    """The bridge for the checkpoint at ``hf_path`` (:func:`bridge_from_config`), NPU spec on."""
    from transformers import AutoConfig

    _auto_bridge()  # the install hint first, if mbridge is missing
    hf_config = AutoConfig.from_pretrained(hf_path, trust_remote_code=trust_remote_code)
    bridge = bridge_from_config(hf_config, dtype=dtype, **bridge_kwargs)
    return use_npu_spec(bridge, kernel=kernel)


def build_model(bridge, *, pre_process: bool | None = None, post_process: bool | None = None):
    """This pipeline stage's ``GPTModel`` (the hybrid model for Nemotron-H) from the bridge's
    model provider, with no ``.cuda()``, DDP or mixed-precision wrapper (so it works on a CPU).
    Needs Megatron's parallel state."""
    from megatron.core import parallel_state

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    provider = bridge._model_provider([])
    return provider(pre_process=pre_process, post_process=post_process)


def load_hf_weights(model, hf_path: str, *, bridge=None, kernel: str = "auto"):
    """Load the Hugging Face safetensors in ``hf_path`` into ``model`` (a ``GPTModel`` or a list
    of chunks in TE names); returns the bridge used (``npu_bridge(hf_path)`` in the model's dtype
    when ``bridge`` is None), for ``export_hf_weights``."""
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
