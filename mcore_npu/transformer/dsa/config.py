"""``DSATransformerConfig``: Megatron's ``MLATransformerConfig`` that admits DSA under CP.

Megatron-Core 0.16.1's ``__post_init__`` asserts ``context_parallel_size == 1`` for
``experimental_attention_variant="dsa"``; the NPU DSA layer gathers its keys over CP ranks. With
CP > 1 this subclass makes Megatron's other DSA check itself (no RoPE fusion) and runs Megatron's
``__post_init__`` with the variant hidden for that call only. Nothing is patched; no new fields."""

from __future__ import annotations

from megatron.core.transformer.transformer_config import MLATransformerConfig

from mcore_npu.transformer.dsa.settings import DSA
from mcore_npu.transformer.megatron_features import require_config_fields

_FIELDS = ("experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_topk")


class DSATransformerConfig(MLATransformerConfig):
    """``MLATransformerConfig`` whose DSA check allows ``context_parallel_size > 1``.

    Raises:
        ValueError: the installed megatron-core has no DSA fields (before 0.16).
    """

    def __init__(self, *args, **kwargs) -> None:
        require_config_fields("DSATransformerConfig", _FIELDS, "DeepSeek Sparse Attention", "0.16")
        super().__init__(*args, **kwargs)

    def __post_init__(self) -> None:
        variant = self.experimental_attention_variant
        if variant != DSA or self.context_parallel_size == 1:
            super().__post_init__()
            return
        if self.apply_rope_fusion:
            raise ValueError(
                "apply_rope_fusion: True with experimental_attention_variant='dsa'; Megatron's "
                "fused RoPE is TE's: set it False (the NPU spec's rope_kernel fuses RoPE)"
            )
        self.experimental_attention_variant = None
        try:
            super().__post_init__()
        finally:
            self.experimental_attention_variant = variant
