"""DeepSeek Sparse Attention's operators (DeepSeek-V3.2, GLM-5), with torch_npu's signatures:

- :func:`lightning_indexer` -> ``torch_npu.npu_lightning_indexer``: for each query, the
  ``sparse_count`` keys of highest index score ``sum_h weights[h] * relu(q_h . k)``;
- :func:`sparse_flash_attention` -> ``torch_npu.npu_sparse_flash_attention`` (backward:
  ``npu_sparse_flash_attention_grad``): softmax attention over the selected keys only.

Layouts: ``BSND`` (``[B, S, N, D]``; ``actual_seq_lengths_*`` per batch, None: the full S) and
``TND`` (packed ``[T, N, D]``; ``actual_seq_lengths_*`` the cumulative ends without a leading 0,
e.g. ``[3, 7]`` for sequences of 3 and 4 tokens; None: one sequence). Key indices are positions
inside their own sequence. ``sparse_mode=3`` is causal, bottom-right aligned: query ``i`` of a
sequence with ``Sq`` queries and ``Skv`` keys sees keys ``j <= i + Skv - Sq`` (``0``: all keys).

The references work in blocks of ``QUERY_BLOCK`` queries: scores are ``[block, N, Skv]`` for the
indexer, and attention gathers only the selected keys (``[block, K * sparse_block_size, D]``).
"""

from mcore_npu.ops.dsa.attention import sparse_flash_attention, validate_sparse_flash_attention
from mcore_npu.ops.dsa.attention_reference import sparse_attention_reference
from mcore_npu.ops.dsa.indexer import (
    indexer_reference,
    lightning_indexer,
    validate_lightning_indexer,
)
from mcore_npu.ops.dsa.kl_loss import (
    KL_LOSS,
    indexer_kl_loss_reference,
    sparse_lightning_indexer_grad_kl_loss,
    validate_indexer_kl_loss,
)
from mcore_npu.ops.dsa.layout import (
    ATTENTION,
    INDEXER,
    INDEXER_HEAD_DIM,
    INDEXER_MAX_HEADS,
    LAYOUTS,
    QUERY_BLOCK,
    SFA_HEAD_DIM,
    SFA_ROPE_DIM,
    SPARSE_MODES,
)

__all__ = [
    "ATTENTION",
    "INDEXER",
    "INDEXER_HEAD_DIM",
    "INDEXER_MAX_HEADS",
    "KL_LOSS",
    "LAYOUTS",
    "QUERY_BLOCK",
    "SFA_HEAD_DIM",
    "SFA_ROPE_DIM",
    "SPARSE_MODES",
    "indexer_kl_loss_reference",
    "indexer_reference",
    "lightning_indexer",
    "sparse_attention_reference",
    "sparse_flash_attention",
    "sparse_lightning_indexer_grad_kl_loss",
    "validate_indexer_kl_loss",
    "validate_lightning_indexer",
    "validate_sparse_flash_attention",
]
