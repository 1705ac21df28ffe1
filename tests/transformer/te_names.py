"""The TE spec's names from specs/param_names_te.yaml, expanded for one model config.

``config`` needs ``num_layers``, ``normalization``, ``qk_layernorm``, ``num_moe_experts``,
``moe_grouped_gemm`` and ``moe_layer_freq`` (a Megatron ``TransformerConfig`` or a
``SimpleNamespace``); ``moe_router_enable_expert_bias``, ``moe_shared_expert_intermediate_size``
and ``moe_shared_expert_gate`` are read where present, ``multi_latent_attention`` and
``q_lora_rank`` where it is an MLA model.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

NAMES = yaml.safe_load((Path(__file__).parents[2] / "specs" / "param_names_te.yaml").read_text())


def _applies(when: str, config, layer_is_moe: bool | None) -> bool:
    """Whether a group's ``when`` clause holds for ``config`` (and this layer)."""
    grouped = bool(getattr(config, "moe_grouped_gemm", False))
    mla = bool(getattr(config, "multi_latent_attention", False))
    q_lora = mla and getattr(config, "q_lora_rank", None) is not None
    conditions = {
        "MLA": mla,
        "not MLA": not mla,
        "q_lora_rank": q_lora,
        "no q_lora_rank": mla and not q_lora,
        "always": True,
        "every layer": True,
        "LayerNorm": config.normalization == "LayerNorm",
        "qk_layernorm": config.qk_layernorm,
        "dense layers": layer_is_moe is False,
        "MoE layers": layer_is_moe is True,
        "sequential experts": not grouped,
        "grouped experts": grouped,
        "add_bias_linear": bool(getattr(config, "add_bias_linear", False)),
        "expert bias": bool(getattr(config, "moe_router_enable_expert_bias", False)),
        "shared experts": getattr(config, "moe_shared_expert_intermediate_size", None) is not None,
        "shared expert gate": bool(getattr(config, "moe_shared_expert_gate", False)),
    }
    return all(conditions[part.strip()] for part in when.split(","))


def _experts(name: str, config) -> range:
    """The local expert indices a name is expanded over: {e} all, {e1} all but 0."""
    experts = config.num_moe_experts or 1
    return range(1, experts) if "{e1}" in name else range(experts)


def expected_names(config, kind: str) -> set[str]:
    """Names from the YAML: ``kind`` = parameters | state_dict | sharded."""
    fields = {"parameters": ("parameters",),
              "state_dict": ("parameters", "extra_state", "buffers", "state_dict_only"),
              "sharded": ("parameters", "extra_state", "buffers", "sharded_only")}[kind]  # fmt: skip
    moe_pattern = config.moe_layer_freq if config.num_moe_experts else [0] * config.num_layers
    names = set()
    for group in NAMES["groups"].values():
        per_layer = "{i}" in group["prefix"]
        layers = [(i, bool(m)) for i, m in enumerate(moe_pattern)] if per_layer else [(0, None)]
        for i, is_moe in layers:
            if not _applies(group["when"], config, is_moe):
                continue
            for field in fields:
                for name in group.get(field, []):
                    for e in _experts(name, config):
                        names.add((group["prefix"] + name).format(i=i, e=e, e1=e))
    return names


def disk_key(name: str, config) -> str:
    """The name on disk of the sharded_state_dict value named ``name`` (the YAML's renames)."""
    for rename in NAMES["checkpoint_key_renames"]:
        if rename["when"] == "dense models" and config.num_moe_experts:
            continue
        pattern = rename["from"].replace("{i}", r"\d+").replace("{e}", r"\d*")
        name = re.sub(pattern, rename["to"], name)
    return name
