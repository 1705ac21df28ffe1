"""Mamba2's operators: the state-space scan (mamba_ssm's ``mamba_chunk_scan_combined``) and the
gated RMSNorm; the causal conv is :func:`mcore_npu.ops.gated_delta.causal_conv1d` (with bias)."""

from mcore_npu.ops.mamba.norm import rms_norm_gated
from mcore_npu.ops.mamba.scan import mamba_chunk_scan_combined, ssd_reference

__all__ = ["mamba_chunk_scan_combined", "rms_norm_gated", "ssd_reference"]
