"""The TE spec's names from specs/param_names_te.yaml, expanded for one model config.

``config`` needs ``num_layers``, ``normalization``, ``qk_layernorm``, ``num_moe_experts`` and
``moe_layer_freq`` (a Megatron ``TransformerConfig`` or a ``SimpleNamespace``).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import yaml

NAMES = yaml.safe_load((Path(__file__).parents[2] / "specs" / "param_names_te.yaml").read_text())


def _applies(when: str, config, layer_is_moe: bool | None) -> bool:
    """Whether a group's ``when`` clause holds for ``config`` (and this layer)."""
    conditions = {
        "always": True,
        "every layer": True,
        "LayerNorm": config.normalization == "LayerNorm",
        "qk_layernorm": config.qk_layernorm,
        "dense layers": layer_is_moe is False,
        "MoE layers": layer_is_moe is True,
    }
    return all(conditions[part.strip()] for part in when.split(","))


def expected_names(config, kind: str) -> set[str]:
    """Names from the YAML: ``kind`` = parameters | state_dict | sharded."""
    fields = {"parameters": ("parameters",),
              "state_dict": ("parameters", "extra_state", "state_dict_only"),
              "sharded": ("parameters", "extra_state")}[kind]  # fmt: skip
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
                    for e in range(config.num_moe_experts or 1):
                        names.add((group["prefix"] + name).format(i=i, e=e))
    return names


def disk_key(name: str, config) -> str:
    for rename in NAMES["checkpoint_key_renames"]:
        if rename["when"] == "dense models" and config.num_moe_experts:
            continue
        for i, e in itertools.product(range(config.num_layers), range(config.num_moe_experts or 1)):
            name = name.replace(rename["from"].format(i=i, e=e), rename["to"])
    return name
