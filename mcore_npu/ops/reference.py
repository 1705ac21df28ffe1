"""Every operator's pure-PyTorch reference under its torch_npu name: what runs off the NPU and
what the NPU kernels are checked against (the registry names each: docs/ops.md)."""

from __future__ import annotations

from mcore_npu.ops.attention_grad import npu_fusion_attention_grad
from mcore_npu.ops.attention_reference import npu_fusion_attention
from mcore_npu.ops.moe_permute import (
    npu_moe_token_permute,
    npu_moe_token_permute_with_routing_map,
    npu_moe_token_unpermute,
    npu_moe_token_unpermute_with_routing_map,
)
from mcore_npu.ops.npu_grouped_matmul import npu_grouped_matmul
from mcore_npu.ops.npu_rms_norm import npu_rms_norm
from mcore_npu.ops.npu_swiglu import npu_swiglu
from mcore_npu.ops.rotary import npu_rotary_mul

__all__ = [
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_grouped_matmul",
    "npu_moe_token_permute",
    "npu_moe_token_permute_with_routing_map",
    "npu_moe_token_unpermute",
    "npu_moe_token_unpermute_with_routing_map",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
]
