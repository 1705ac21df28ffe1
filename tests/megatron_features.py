"""Which ``TransformerConfig`` fields the installed megatron-core has, for tests of features
that cannot exist on a version without them (megatron-core 0.15 has no Gated DeltaNet fields,
no ``attention_output_gate``, no ``moe_shared_expert_gate``).

``needs_fields`` skips such a test there with a reason naming the feature, the missing fields,
the version that has them and the test that checks the plugin's one-line refusal on that
version instead (``tests/transformer/test_version_refusals.py``). Read from the installed class,
never from a version string.
"""

from __future__ import annotations

import pytest

from mcore_npu.transformer.megatron_features import config_fields, version_with

REFUSALS = "tests/transformer/test_version_refusals.py"
GDN_CONFIG_FIELDS = (
    "experimental_attention_variant",
    "linear_num_key_heads",
    "linear_attention_freq",
)
DSA_CONFIG_FIELDS = ("experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_topk")


def missing_fields(*names: str) -> list[str]:
    """The ``names`` the installed ``TransformerConfig`` does not have."""
    return [name for name in names if name not in config_fields()]


def needs_fields(*names: str, feature: str) -> pytest.MarkDecorator:
    """Skip where the installed megatron-core lacks any of ``names`` (the reason says why)."""
    missing = missing_fields(*names)
    reason = ""
    if missing:
        reason = (f"{feature} needs TransformerConfig.{', '.join(missing)}, which "
                  f"{version_with(missing[0])} has and the installed megatron-core has not; "
                  f"{REFUSALS} checks the plugin's one-line refusal here")  # fmt: skip
    return pytest.mark.skipif(bool(missing), reason=reason)
