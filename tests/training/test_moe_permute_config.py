"""The trainer's ``fused.moe_permute`` key: default off, YAML's boolean `off`, refusals naming
the key, and the value reaching the spec (``NPUMoELayer``) without touching Megatron's
``moe_permute_fusion`` (whose TE-only check would refuse it)."""

from __future__ import annotations

import functools

import pytest

from mcore_npu.training.config import ConfigError, load_config
from tests.launch import CONFIGS
from tests.transformer.moe_models import module_of


def test_moe_permute_is_off_by_default_and_survives_yamls_boolean_reading(tmp_path):
    assert load_config(CONFIGS / "gpt_tiny_moe.yaml").fused.moe_permute == "off"
    (tmp_path / "off.yaml").write_text("fused:\n  moe_permute: off\n")
    assert load_config(tmp_path / "off.yaml").fused.moe_permute == "off"
    cfg = load_config(CONFIGS / "gpt_tiny_moe.yaml", ["fused.moe_permute=reference"])
    assert cfg.fused.moe_permute == "reference"


@pytest.mark.parametrize("overrides", [["fused.moe_permute=fast"],
                                       ["attention.backend=local", "fused.moe_permute=auto"]])  # fmt: skip
def test_bad_moe_permute_is_refused_naming_the_key(overrides):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "gpt_tiny_moe.yaml", overrides)
    assert str(info.value).startswith("config fused.moe_permute"), str(info.value)


@pytest.mark.usefixtures("megatron_runtime")
@pytest.mark.parametrize("value, layer", [("reference", "NPUMoELayer"), ("off", "MoELayer")])
def test_the_key_reaches_the_spec_and_never_megatrons_config(value, layer):
    from mcore_npu.training.model import layer_spec, transformer_config

    cfg = load_config(CONFIGS / "gpt_tiny_moe.yaml", ["attention.backend=npu_fusion",
                                                      f"fused.moe_permute={value}"])  # fmt: skip
    config = transformer_config(cfg)
    assert config.moe_permute_fusion is False
    spec = layer_spec(cfg, config).layer_specs[0].submodules.mlp
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    if layer == "MoELayer" and "router" not in MoESubmodules.__dataclass_fields__:
        layer = "NPURouterMoELayer"  # 0.15 has no router slot: MoELayer with the NPU router
    assert module_of(spec).__name__ == layer and issubclass(module_of(spec), MoELayer)
    # "off" leaves Megatron's spec: a ModuleSpec, or on 0.18+ a functools.partial (no params)
    params = spec.keywords if isinstance(spec, functools.partial) else spec.params
    assert params.get("permute_kernel") == (value if value != "off" else None)
