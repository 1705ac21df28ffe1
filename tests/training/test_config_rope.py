"""The trainer's ``fused.rope`` key and Megatron's ``apply_rope_fusion`` spelling: validated like
the other fused keys, and ``apply_rope_fusion: true`` never reaches ``TransformerConfig`` (whose
check would demand Transformer Engine); the intent lives in the spec's ``rope_kernel``."""

from __future__ import annotations

import pytest

from mcore_npu.training.config import ConfigError, load_config
from tests.training.test_config import CONFIGS

pytestmark = pytest.mark.usefixtures("megatron_runtime")

BAD = [
    (["fused.rope=npu"], "fused.rope", "unknown choice"),
    (["attention.backend=local", "fused.rope=reference"], "fused.rope", "npu_fusion backend"),
]


@pytest.mark.parametrize("overrides, key, text", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_rope_setting_is_refused_naming_the_key(overrides, key, text):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "gpt_tiny.yaml", overrides, world_size=2)
    assert str(info.value).startswith(f"config {key}") and text in str(info.value)


def test_rope_is_off_by_default_and_off_survives_yaml(tmp_path):
    from mcore_npu.training.model import rope_kernel

    assert load_config(CONFIGS / "gpt_tiny.yaml").fused.rope == "off"
    (tmp_path / "off.yaml").write_text("fused:\n  rope: off\n")
    cfg = load_config(tmp_path / "off.yaml")
    assert cfg.fused.rope == "off" and rope_kernel(cfg) == "off"


@pytest.mark.parametrize("overrides, want", [
    (["fused.rope=reference"], "reference"),
    (["fused.rope=null"], None),
    (["model.extra.apply_rope_fusion=true"], None),  # Megatron's key: attention.kernel
])  # fmt: skip
def test_the_model_gets_the_fused_rope_and_megatron_never_sees_apply_rope_fusion(overrides, want):
    from mcore_npu.training.model import layer_spec, rope_kernel, transformer_config
    from mcore_npu.transformer.rope import NPURotarySelfAttention

    cfg = load_config(CONFIGS / "gpt_tiny.yaml", ["attention.backend=npu_fusion", *overrides])
    assert rope_kernel(cfg) == want
    config = transformer_config(cfg)  # would raise "apply_rope_fusion is not available" if set
    assert config.apply_rope_fusion is False
    spec = layer_spec(cfg, config)
    assert {s.submodules.self_attention.module for s in spec.layer_specs} == {
        NPURotarySelfAttention
    }
