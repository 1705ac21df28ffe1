"""mcore_npu: Megatron-Core on Ascend NPUs, a plugin (not a fork).

A layer spec whose core attention calls ``torch_npu.npu_fusion_attention``, masks that cost
nothing per step, and expandable segments at start-up; a pure-PyTorch reference of the operator
elsewhere. Importing this package imports neither torch, megatron-core, torch_npu nor
transformer-engine: the public names below are resolved on first use. The rooms and their
layering: docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first attribute access)
_EXPORTS = {
    "fusion_attention": "mcore_npu.ops",
    "npu_fusion_attention": "mcore_npu.ops.reference",
    "npu_rms_norm": "mcore_npu.ops.reference",
    "npu_swiglu": "mcore_npu.ops.reference",
    "npu_grouped_matmul": "mcore_npu.ops.reference",
    "compressed_causal_mask": "mcore_npu.masks",
    "build_npu_attention_mask": "mcore_npu.masks",
    "padding_to_packed": "mcore_npu.masks",
    "NPUFusionAttention": "mcore_npu.transformer.attention",
    "thd_get_partitioned_indices": "mcore_npu.transformer.context_parallel.thd",
    "get_thd_batch_on_this_cp_rank": "mcore_npu.transformer.context_parallel.thd",
    "NPUTopKRouter": "mcore_npu.transformer.router",
    "NPUGroupedMLP": "mcore_npu.transformer.experts",
    "NPUMLP": "mcore_npu.transformer.mlp",
    "NPURMSNorm": "mcore_npu.transformer.norms",
    "get_gpt_layer_npu_spec": "mcore_npu.transformer.layer_specs",
    "get_gpt_decoder_block_npu_spec": "mcore_npu.transformer.layer_specs",
    "get_gpt_mtp_block_npu_spec": "mcore_npu.transformer.layer_specs",
    "get_gpt_layer_spec": "mcore_npu.transformer.layer_specs",
    "get_hybrid_stack_npu_spec": "mcore_npu.transformer.mamba.spec",
    "NPUMambaMixer": "mcore_npu.transformer.mamba",
    "resolve_backend": "mcore_npu.transformer.backends",
    "PARAM_LAYOUTS": "mcore_npu.transformer.backends",
    "NormColumnParallelLinear": "mcore_npu.transformer.norm_linear",
    "NPUSpecProvider": "mcore_npu.transformer.spec_provider",
    "current_accelerator": "mcore_npu.allocator.device",
    "current_device": "mcore_npu.allocator.device",
    "ExpandableSegmentsWarning": "mcore_npu.allocator.device",
    "is_npu_available": "mcore_npu.allocator.device",
    "set_expandable_segments": "mcore_npu.allocator.device",
    "expandable_segments": "mcore_npu.allocator.device",
    "ExpandableSegmentsMixin": "mcore_npu.allocator.workers",
    "load_config": "mcore_npu.training.config",
    "build_model": "mcore_npu.training.model",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'mcore_npu' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
