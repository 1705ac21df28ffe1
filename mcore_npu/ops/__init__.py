"""The operators: ``mcore_npu.ops.<name>`` for every public one, resolved on first use (so
``import mcore_npu.ops.registry`` imports no torch). Which kernel runs a call is the registry's
answer (``mcore_npu.ops.registry``, docs/ops.md); the references are in
``mcore_npu.ops.reference``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "batch_invariant_attention": "batch_invariant",
    "batch_invariant_linear": "batch_invariant_rows",
    "batch_invariant_sum": "batch_invariant_rows",
    "fusion_attention": "attention",
    "lightning_indexer": "dsa",
    "sparse_flash_attention": "dsa",
    "sparse_lightning_indexer_grad_kl_loss": "dsa",
    "fusion_attention_grad": "attention",
    "fusion_attention_with_stats": "attention",
    "grouped_linear": "fused",
    "grouped_matmul": "fused",
    "rms_norm": "fused",
    "swiglu": "fused",
    "rotary_mul": "fused_rotary",
    "mrope_angles": "mrope",
    "moe_token_permute": "permute_dispatch",
    "moe_token_permute_with_routing_map": "permute_dispatch",
    "moe_token_unpermute": "permute_dispatch",
    "moe_token_unpermute_with_routing_map": "permute_dispatch",
    "chunk_gated_delta_rule": "gated_delta",
    "causal_conv1d": "gated_delta",
    "gated_rms_norm": "gated_delta",
    "l2norm": "gated_delta",
    "mamba_chunk_scan_combined": "mamba",
    "rms_norm_gated": "mamba",
    "KERNELS": "registry",
    "OPERATORS": "registry",
    "check_kernel": "registry",
    "resolve": "registry",
    "resolve_kernel": "legacy",
    "load_torch_npu": "legacy",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mcore_npu.ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mcore_npu.ops.{module}"), name)
    globals()[name] = value
    return value
