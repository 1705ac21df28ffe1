"""Gated DeltaNet operators (Qwen3.5 / Qwen3-Next linear attention), fla's calling convention.

* ``chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None,
  output_final_state=False, cu_seqlens=None, use_qk_l2norm_in_kernel=False) -> (o, final_state)``
* ``causal_conv1d(x, weight, bias=None, *, cu_seqlens=None) -> y`` (depthwise, SiLU)
* ``l2norm(x, eps=1e-6)`` and ``gated_rms_norm(x, z, weight, eps)``

Shapes are given in each function's docstring.
"""

from mcore_npu.ops.gated_delta.conv import causal_conv1d
from mcore_npu.ops.gated_delta.norms import gated_rms_norm, l2norm
from mcore_npu.ops.gated_delta.rule import chunk_gated_delta_rule

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "gated_rms_norm", "l2norm"]
