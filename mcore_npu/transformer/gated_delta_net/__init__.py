"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) in Megatron's spec, without fla/TE.

- ``NPUGatedDeltaNet`` (``layer.py``): Megatron 0.16.1's ``GatedDeltaNet`` names and checkpoint
  splits on ``mcore_npu.ops.gated_delta``; sbhd and packed thd, TP + SP, recompute, a CP seam.
- ``GDNTransformerConfig`` (``config.py``): admits GDN with ``context_parallel_size > 1``.
- ``hybrid_layer_specs`` / ``linear_attention_pattern`` (``spec.py``): the hybrid block, used by
  ``get_gpt_decoder_block_npu_spec`` when ``experimental_attention_variant="gated_delta_net"``.
"""

from mcore_npu.transformer.gated_delta_net.config import GDNTransformerConfig, check_gdn_fields
from mcore_npu.transformer.gated_delta_net.layer import (
    NoContextParallel,
    NPUGatedDeltaNet,
    NPUGatedDeltaNetSubmodules,
)
from mcore_npu.transformer.gated_delta_net.spec import (
    gdn_attention_spec,
    hybrid_layer_specs,
    is_gdn,
    linear_attention_pattern,
)

__all__ = [
    "GDNTransformerConfig",
    "NPUGatedDeltaNet",
    "NPUGatedDeltaNetSubmodules",
    "NoContextParallel",
    "check_gdn_fields",
    "gdn_attention_spec",
    "hybrid_layer_specs",
    "is_gdn",
    "linear_attention_pattern",
]
