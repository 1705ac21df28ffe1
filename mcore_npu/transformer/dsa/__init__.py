"""DeepSeek Sparse Attention layers (DeepSeek-V3.2, GLM-5) for the NPU spec: MLA whose attention
runs in the absorbed form over the keys a lightning indexer picks. See docs/dsa.md."""

from mcore_npu.transformer.dsa.config import DSATransformerConfig
from mcore_npu.transformer.dsa.core import NPUSparseAttention
from mcore_npu.transformer.dsa.indexer import DSAIndexer
from mcore_npu.transformer.dsa.self_attention import NPUDSASelfAttention
from mcore_npu.transformer.dsa.settings import (
    SPEC_KEYWORDS,
    DSASettings,
    dsa_settings,
    is_dsa,
)

__all__ = [
    "SPEC_KEYWORDS",
    "DSAIndexer",
    "DSATransformerConfig",
    "DSASettings",
    "NPUDSASelfAttention",
    "NPUSparseAttention",
    "dsa_settings",
    "is_dsa",
]
