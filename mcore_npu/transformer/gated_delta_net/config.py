"""``GDNTransformerConfig``: Megatron's ``TransformerConfig`` that admits Gated DeltaNet under CP.

Megatron-Core 0.16.1's ``__post_init__`` asserts ``context_parallel_size == 1`` for GDN. This
subclass runs Megatron's other GDN checks itself (as ``ValueError`` s with the fix), then Megatron's
``__post_init__`` with the variant hidden for that call only. Nothing is patched. Under CP the GDN
heads split over ``tp * cp`` ranks, so both head counts must divide by it."""

from __future__ import annotations

from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_npu.transformer.megatron_features import require_config_fields

GDN = "gated_delta_net"

_HEAD_FIELDS = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


class GDNTransformerConfig(TransformerConfig):
    """``TransformerConfig`` whose Gated DeltaNet checks allow ``context_parallel_size > 1`` (no new
    fields).

    Raises:
        ValueError: the installed megatron-core has no Gated DeltaNet fields (before 0.16).
    """

    def __init__(self, *args, **kwargs) -> None:
        fields = ("experimental_attention_variant", *_HEAD_FIELDS)
        require_config_fields("GDNTransformerConfig", fields, "Gated DeltaNet", "0.16")
        super().__init__(*args, **kwargs)

    def __post_init__(self) -> None:
        variant = self.experimental_attention_variant
        if variant != GDN:
            super().__post_init__()
            return
        check_gdn_fields(self)
        self.experimental_attention_variant = None  # Megatron's GDN block would assert CP == 1
        try:
            super().__post_init__()
        finally:
            self.experimental_attention_variant = variant


def check_gdn_fields(config) -> None:
    """Megatron 0.16.1's GDN checks as ValueErrors, with CP allowed (heads split over TP x CP)."""
    if getattr(config, "linear_attention_freq", None) is None:
        raise ValueError(
            "linear_attention_freq: None with experimental_attention_variant='gated_delta_net'; "
            "set an int N (every N-th layer is full attention) or a list (1 = GDN layer)"
        )
    for name in _HEAD_FIELDS:
        value = getattr(config, name, None)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: {value!r}; set a positive int for the GDN layers")
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    if value_heads % key_heads:
        raise ValueError(
            f"linear_num_value_heads: {value_heads} is not a multiple of linear_num_key_heads "
            f"({key_heads}); pick a multiple (value head h reads key head h // (HV // H))"
        )
    ranks = config.tensor_model_parallel_size * config.context_parallel_size
    for name, heads in (
        ("linear_num_key_heads", key_heads),
        ("linear_num_value_heads", value_heads),
    ):
        if heads % ranks:
            raise ValueError(
                f"{name}: {heads} heads do not split over tensor_model_parallel_size x "
                f"context_parallel_size = {ranks} ranks; use a multiple of {ranks} or fewer ranks"
            )
