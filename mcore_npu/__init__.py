"""mcore_npu: Megatron-Core on Ascend NPUs.

The package is a plugin, not a fork: it gives Megatron-Core a transformer-layer spec whose core
attention calls ``torch_npu.npu_fusion_attention``, masks that cost nothing per step, and a worker
mixin that turns on the allocator's expandable segments at start-up. Everything also runs on
machines without an NPU through a pure-PyTorch reference of the operator.

Importing this package is cheap: it imports neither torch, megatron-core, torch_npu nor
transformer-engine. The public names below are resolved on first use.

Rooms, bottom up (each imports only the rooms below it; ``tests/test_layering.py`` checks)::

    ops/           the operators: contracts, validation, references, kernel dispatch
    allocator/     accelerator detection, expandable segments, the worker mixin
    masks/         the compressed-mask cache, mask descriptions, per-step memos, helpers
    transformer/   NPUFusionAttention, norms and the layer-spec builders (Megatron's slots)
    training/      the demo trainer behind ``mcore-npu train``
    tools/         doctor, verify, bench
    integrations/  adapters for other frameworks, imported only on demand
    cli            the ``mcore-npu`` command; ``python -m mcore_npu.train`` for torchrun

The plugin a Megatron user needs is ops, masks, transformer and allocator; the names below are
its public face.
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
