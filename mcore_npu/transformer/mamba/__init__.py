"""Mamba2 in Megatron's hybrid stack: :class:`NPUMambaMixer` (the ``MambaLayer`` mixer slot) and
its gated norm. See docs/mamba_layer.md."""

from mcore_npu.transformer.mamba.mixer import NPUMambaMixer, NPUMambaMixerSubmodules
from mcore_npu.transformer.mamba.norm import MambaGatedRMSNorm

__all__ = ["MambaGatedRMSNorm", "NPUMambaMixer", "NPUMambaMixerSubmodules"]
