"""mbridge bridges whose Megatron config this stack cannot build as they stand: the plugin's
subclasses, which fix the keywords the bridge's constructor gives its config class.

mbridge 0.15.1 builds the config inside the bridge's constructor, so the fixes live in subclasses
of mbridge's classes (``isinstance`` holds, the weight maps are the same, mbridge is unchanged).
For ``deepseek_v3`` with transformers 5 and megatron-core 0.16.1:

1. ``rope_theta`` lives in ``rope_parameters`` (fixed before, by ``hf.expose_hf_config_fields``);
2. ``max_position_embeddings`` -> MLA's ``original_max_position_embeddings``;
3. the yarn values and the RoPE type are read from ``rope_parameters`` (mbridge silently built
   plain RoPE); types other than default / yarn are refused;
4. ``n_group`` / ``topk_group`` -> ``moe_router_num_groups`` / ``moe_router_group_topk``;
5. a checkpoint without FP8 weights is read by mbridge's plain ``SafeTensorIO``, in any dtype.

Routings Megatron's sigmoid router cannot compute raise ``ValueError``; keywords given through
``bridge.set_extra_args`` still win. See docs/hf_weights.md.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging

logger = logging.getLogger(__name__)

# model_type -> (module, class) of the mbridge bridge the plugin subclasses
FIXED_BRIDGES = {"deepseek_v3": ("mbridge.models.deepseek_v3", "DeepseekV3Bridge")}
QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
QWEN3_5_HUB_TYPES = ("qwen3_5", "qwen3_5_moe")  # the hub form: vision tower and language model
NEMOTRON_H_TYPES = ("nemotron_h",)
QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
DSA_TYPES = ("glm_moe_dsa", "deepseek_v32")  # DeepSeek Sparse Attention: GLM-5, DeepSeek-V3.2
PLUGIN_BRIDGES = QWEN3_5_TYPES + NEMOTRON_H_TYPES + QWEN3_VL_TYPES + DSA_TYPES
"""Model types mbridge has no bridge for, bridged by the plugin (``integrations.hf_qwen3_5``,
``integrations.hf_nemotron_h``, ``integrations.hf_qwen3_vl_bridge``, ``integrations.hf_dsa``)."""
FP8_SCALE_SUFFIX = "_scale_inv"  # an FP8 weight's block scales (DeepSeek-V3's FP8 release)

_RENAMED_KEYWORDS = {"max_position_embeddings": "original_max_position_embeddings"}
_MLA_ROPE_TYPES = {"default": "rope", "rope": "rope", "yarn": "yarn"}
# Hugging Face rope_parameters key -> MLATransformerConfig field (as mbridge maps them)
_ROPE_KEYWORDS = {
    "factor": "rotary_scaling_factor",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "original_max_position_embeddings": "original_max_position_embeddings",
}


def needs_fixed_bridge(hf_config) -> bool:
    """Whether mbridge's own bridge for this Hugging Face config cannot build its config."""
    return getattr(hf_config, "model_type", None) in FIXED_BRIDGES


def fixed_bridge_class(model_type: str) -> type:
    """The plugin's subclass of mbridge's bridge for ``model_type`` (one class per type)."""
    if model_type not in FIXED_BRIDGES:
        raise ValueError(
            f"model_type: {model_type!r} needs no fixed bridge (those: {', '.join(FIXED_BRIDGES)}); "
            "use mbridge.AutoBridge.from_config"
        )
    return _fixed_class(model_type)


@functools.cache
def _fixed_class(model_type: str) -> type:
    module, name = FIXED_BRIDGES[model_type]
    base = getattr(importlib.import_module(module), name)
    mixins = (_ConfigKeywordFixes, _UnquantisedSafetensors)
    return type(f"NPU{name}", (*mixins, base), {"__module__": __name__})


class _ConfigKeywordFixes:
    """Mixin for an mbridge ``LLMBridge``: the config keywords fixed (see the module docstring)."""

    def _build_base_config(self, text_config_key=None, **keywords):
        keywords = deepseek_v3_keywords(self.hf_config, self.TransformerConfigClass, keywords)
        return super()._build_base_config(text_config_key=text_config_key, **keywords)


class _UnquantisedSafetensors:
    """Mixin for mbridge's ``DeepseekV3Bridge``: fix 5 of the module docstring."""

    def _get_safetensor_io(self, weights_path: str):
        from mbridge.core.safetensor_io import SafeTensorIO

        plain = SafeTensorIO(self._get_actual_hf_path(weights_path))
        if has_fp8_weights(plain.load_hf_weight_names()):
            return super()._get_safetensor_io(weights_path)  # mbridge's FP8 reader
        return plain


def has_fp8_weights(names) -> bool:
    """Whether a checkpoint's tensor names include FP8 block scales (``*_scale_inv``)."""
    return any(name.endswith(FP8_SCALE_SUFFIX) for name in names)


def deepseek_v3_keywords(hf_config, config_class: type, keywords: dict) -> dict:
    """The keywords of ``DeepseekV3Bridge._build_config`` with fixes 2-4 applied (a new dict);
    ``ValueError`` for a routing or RoPE type Megatron cannot compute."""
    keywords = _renamed_for(config_class, keywords)
    keywords.update(_rope_scaling(hf_config, keywords))
    keywords.update(_group_limited_routing(hf_config, keywords))
    _check_topk_weights(hf_config)
    return keywords


def _renamed_for(config_class: type, keywords: dict) -> dict:
    fields = {f.name for f in dataclasses.fields(config_class)}
    renamed = dict(keywords)
    for old, new in _RENAMED_KEYWORDS.items():
        if old in renamed and old not in fields and new in fields:
            renamed[new] = renamed.pop(old)
    return renamed


def _rope_parameters(hf_config) -> dict:
    """transformers 5: ``rope_parameters``; before: ``rope_scaling`` (None without scaling)."""
    return dict(
        getattr(hf_config, "rope_parameters", None)
        or getattr(hf_config, "rope_scaling", None)
        or {}
    )


def _rope_scaling(hf_config, keywords: dict) -> dict:
    """The RoPE keywords from ``rope_parameters`` (those the bridge passes; see fix 3)."""
    rope = _rope_parameters(hf_config)
    passed = {key: field for key, field in _ROPE_KEYWORDS.items() if field in keywords}
    fixed = {field: rope[key] for key, field in passed.items() if key in rope}
    kind = rope.get("type", rope.get("rope_type"))
    if kind is None or "rope_type" not in keywords:
        return fixed
    if kind not in _MLA_ROPE_TYPES:
        raise ValueError(
            f"rope_parameters.rope_type: {kind!r}; Megatron's MLA has rope_type 'rope' or "
            "'yarn' only (MLATransformerConfig); use a default or yarn RoPE checkpoint"
        )
    return {**fixed, "rope_type": _MLA_ROPE_TYPES[kind]}


def _group_limited_routing(hf_config, keywords: dict) -> dict:
    """``n_group`` / ``topk_group`` -> Megatron's group-limited top-k, when they limit anything."""
    groups = int(getattr(hf_config, "n_group", None) or 1)
    chosen = int(getattr(hf_config, "topk_group", None) or groups)
    if groups <= 1 or chosen >= groups:
        return {}
    topk = int(hf_config.num_experts_per_tok)
    if topk // chosen != 2:
        raise ValueError(
            f"topk_group: {chosen} with num_experts_per_tok={topk}; the Hugging Face model "
            "scores each expert group by its two best experts, Megatron's group-limited top-k "
            f"by its best topk // group_topk = {topk // chosen}; this checkpoint's routing "
            "cannot be reproduced (DeepSeek-V3 has 8 // 4 = 2)"
        )
    fixed = {"moe_router_num_groups": groups, "moe_router_group_topk": chosen}
    return {key: value for key, value in fixed.items() if key not in keywords}


def _check_topk_weights(hf_config) -> None:
    """Megatron's sigmoid router renormalises the top-k weights exactly when top-k > 1."""
    topk = int(hf_config.num_experts_per_tok)
    normalised = bool(getattr(hf_config, "norm_topk_prob", True))
    if normalised != (topk > 1):
        raise ValueError(
            f"norm_topk_prob: {normalised} with num_experts_per_tok={topk}; Megatron's sigmoid "
            "router (moe_utils.topk_routing_with_score_function) renormalises the top-k weights "
            "exactly when top-k > 1, and no TransformerConfig field changes that; this "
            "checkpoint's expert weights cannot be reproduced"
        )


def mbridge_expert_form(config) -> dict:
    """``{"moe_grouped_gemm": True}`` for an MoE config asking for sequential experts (one log
    line), else ``{}``: mbridge maps only the grouped experts' names, and the grouped experts
    compute the same function of the same weights (docs/weight_path.md)."""
    if not getattr(config, "num_moe_experts", None) or getattr(config, "moe_grouped_gemm", True):
        return {}
    logger.info(
        "moe_grouped_gemm=False: mbridge maps only grouped expert names "
        "(mlp.experts.linear_fc1.weight{e}), so the grouped experts are built instead "
        "(NPUGroupedMLP: the same computation of the same weights); Megatron-Bridge "
        "(vanilla_mbridge=False) and the plugin's own trainer build sequential experts"
    )
    return {"moe_grouped_gemm": True}
