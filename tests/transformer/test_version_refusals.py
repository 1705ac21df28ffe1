"""Features a megatron-core version cannot have are refused by the plugin in one line that names
the version that has them; where the installed megatron-core has them, the same inputs work.

Runs on every admitted version (``make test-compat``): what the installed Megatron has is read
from its ``TransformerConfig`` fields, never from its version string. The tests these features'
own files skip there (``tests/megatron_features.needs_fields``) point here.
"""

from __future__ import annotations

import pytest

from mcore_npu.training.config import ConfigError, load_config
from mcore_npu.transformer.megatron_features import version_with
from tests.launch import CONFIGS
from tests.megatron_features import (
    DSA_CONFIG_FIELDS,
    GDN_CONFIG_FIELDS,
    config_fields,
    missing_fields,
)

pytestmark = [pytest.mark.cpu_only]


def _one_line(err: BaseException) -> str:
    message = str(err)
    assert "\n" not in message and "Traceback" not in message, message
    return message


@pytest.mark.parametrize(
    ("field", "value"),
    [("moe_shared_expert_gate", True), ("attention_output_gate", True),
     ("batch_invariant_mode", False)],
)  # fmt: skip
def test_a_yaml_key_of_a_newer_megatron_is_refused_naming_its_version(field, value):
    """``mcore-npu train`` reads the model section with ``load_config``: a field of the installed
    ``TransformerConfig`` passes through to it; one it lacks is refused naming the version."""
    overrides = [f"model.{field}={str(value).lower()}"]
    if field in config_fields():
        cfg = load_config(CONFIGS / "gpt_tiny_moe.yaml", overrides)
        assert cfg.model.extra[field] == value
        return
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "gpt_tiny_moe.yaml", overrides)
    message = _one_line(info.value)
    assert message.startswith(f"config model.{field}=")
    assert f"{version_with(field)} has {field}: install that version" in message


def test_a_gated_deltanet_config_is_refused_naming_the_version():
    from mcore_npu.transformer.gated_delta_net import GDNTransformerConfig
    from tests.transformer.gdn_models import gdn_config

    if not missing_fields(*GDN_CONFIG_FIELDS):
        assert type(gdn_config()) is GDNTransformerConfig
        assert load_config(CONFIGS / "gpt_tiny_gdn.yaml").model.num_layers > 0
        return
    with pytest.raises(ValueError) as info:
        gdn_config()
    message = _one_line(info.value)
    assert message.startswith("GDNTransformerConfig: the installed megatron-core")
    assert "install megatron-core>=0.16" in message
    with pytest.raises(ConfigError) as info:  # mcore-npu train --config configs/gpt_tiny_gdn.yaml
        load_config(CONFIGS / "gpt_tiny_gdn.yaml")
    assert "megatron-core 0.16+ has" in _one_line(info.value)


def test_a_dsa_config_is_refused_naming_the_version():
    from mcore_npu.transformer.dsa import DSATransformerConfig
    from tests.transformer.mla_models import dsa_config

    if not missing_fields(*DSA_CONFIG_FIELDS):
        assert type(dsa_config(topk=4)) is DSATransformerConfig
        assert load_config(CONFIGS / "gpt_tiny_dsa.yaml").model.num_layers > 0
        return
    with pytest.raises(ValueError) as info:
        dsa_config(topk=4)
    message = _one_line(info.value)
    assert message.startswith("DSATransformerConfig: the installed megatron-core")
    assert "install megatron-core>=0.16" in message
    with pytest.raises(ConfigError) as info:  # mcore-npu train --config configs/gpt_tiny_dsa.yaml
        load_config(CONFIGS / "gpt_tiny_dsa.yaml")
    assert "megatron-core 0.16+ has" in _one_line(info.value)


@pytest.mark.usefixtures("megatron_runtime")
def test_multi_token_prediction_without_a_loss_scale_is_refused():
    """megatron-core 0.15's ``mtp_loss_scaling_factor`` defaults to None, which its MTP loss
    divides (0.16+: 0.1): the trainer refuses there unless the YAML sets it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_npu.training.model import layer_spec, mtp_spec, transformer_config

    cfg = load_config(CONFIGS / "gpt_tiny.yaml", ["model.mtp_num_layers=1"])
    config = transformer_config(cfg)
    block = layer_spec(cfg, config)
    default = TransformerConfig.__dataclass_fields__["mtp_loss_scaling_factor"].default
    if default is not None:
        assert config.mtp_loss_scaling_factor == default and mtp_spec(cfg, config, block)
        return
    with pytest.raises(ValueError) as info:
        mtp_spec(cfg, config, block)
    message = _one_line(info.value)
    assert "megatron-core 0.16+ defaults it to 0.1" in message
    assert message.endswith("set model.mtp_loss_scaling_factor")
    given = load_config(CONFIGS / "gpt_tiny.yaml",
                        ["model.mtp_num_layers=1", "model.mtp_loss_scaling_factor=0.1"])  # fmt: skip
    config = transformer_config(given)
    assert mtp_spec(given, config, layer_spec(given, config)) is not None
