"""The Mamba2 mixer's gated RMSNorm as a module: Megatron's ``ExtendedRMSNorm`` (mamba_ssm's
``RMSNorm`` with groups), parameter ``weight [d_inner / tp]`` TP-sharded on axis 0."""

from __future__ import annotations

import torch

from mcore_npu.ops.mamba import rms_norm_gated


class MambaGatedRMSNorm(torch.nn.Module):
    """``y [..., N]``, ``z [..., N]`` or None -> ``weight * rms_group(y * silu(z))`` (gate first,
    ``norm_before_gate=False``), in y's dtype; ``group_size`` channels per group."""

    def __init__(
        self,
        hidden_size,
        eps=1e-5,
        group_size=None,
        norm_before_gate=False,
        device=None,
        dtype=None,
        tp_group=None,
    ):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 0
        self.tp_group = tp_group

    def forward(self, y: torch.Tensor, z: torch.Tensor | None = None, rows=None) -> torch.Tensor:
        """``rows``: the slice of ``weight`` that ``y``'s channels are (a CP rank's heads)."""
        weight = self.weight if rows is None else self.weight[rows]
        return rms_norm_gated(
            y,
            weight,
            z,
            eps=self.eps,
            group_size=self.group_size,
            norm_before_gate=self.norm_before_gate,
        )

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """``weight`` TP-sharded on axis 0 (Megatron's ``ExtendedRMSNorm``)."""
        from mcore_npu.transformer.mixer_support import sharded_tensors

        state = self.state_dict(prefix="", keep_vars=True)
        return sharded_tensors(
            state, prefix, {"weight": 0}, sharded_offsets, metadata, self.tp_group
        )
