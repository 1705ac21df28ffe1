"""The GDN output norm (``out_norm``): ``y = weight * rmsnorm(x) * silu(z)`` per value head.

As Qwen3.5 / Qwen3-Next's ``RMSNormGated``: ``weight`` ``[V]`` starts at 1 and is never
zero-centred; in the te layout also an empty ``_extra_state``. Every TP rank holds the whole weight
but normalises its own heads, so its gradient is summed over the TP group inside the forward (and it
is not tagged ``sequence_parallel``)."""

from __future__ import annotations

import torch

from mcore_npu.ops.gated_delta import gated_rms_norm
from mcore_npu.transformer.extra_state import EmptyExtraState


class GatedRMSNorm(torch.nn.Module):
    """``weight * rmsnorm(x) * silu(z)``: x, z ``[..., V]`` -> ``[..., V]`` in x's dtype."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, tp_group=None, **_unused):
        super().__init__()
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = float(eps)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.tp_group is not None and self.tp_group.size() > 1:
            from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        return gated_rms_norm(x, z, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class TEGatedRMSNorm(EmptyExtraState, GatedRMSNorm):
    """:class:`GatedRMSNorm` with TE's ``_extra_state`` entry (``param_layout="te"``)."""
