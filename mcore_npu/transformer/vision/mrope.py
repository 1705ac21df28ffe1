"""Qwen3-VL's interleaved multimodal RoPE as Megatron's rotary module.

:class:`InterleavedMultimodalRotaryEmbedding` is Megatron's ``MultimodalRotaryEmbedding`` (same
constructor, same ``forward(position_ids [3, B, S], mrope_section, cp_group)``) whose angles
follow Qwen3-VL's interleaving (``mcore_npu.ops.mrope_angles``): ``[S, B, 1, rot]`` fp32 of
the positions given (under context parallelism the packed batch's whole, see ``forward``). The plugin's fused RoPE
(``NPURotarySelfAttention``) rotates with them through ``rotary_mul``, cos/sin once per batch."""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding,
)

from mcore_npu.ops import mrope_angles


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """Megatron's ``MultimodalRotaryEmbedding`` with Qwen3-VL's interleaved T/H/W frequencies;
    ``inv_freq`` ``[rot/2]`` fp32 is made on the host and follows the positions' device (it stays
    fp32 when the model is cast)."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor=None,
        rotary_base: int = 10000,
        cp_group=None,
    ):
        torch.nn.Module.__init__(self)
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else kv_channels
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def forward(self, position_ids, mrope_section, cp_group=None):
        """Angles ``[S, B, 1, rot]`` of exactly ``position_ids [3, B, S]``, never split here:
        ``NPUQwen3VLModel`` passes a packed batch's whole positions, from which the fused RoPE
        picks this CP rank's (``cp_group`` is accepted for Megatron's call and not used)."""
        if self.seq_len_interpolation_factor is not None:
            raise ValueError(
                f"seq_len_interpolation_factor: {self.seq_len_interpolation_factor}; Qwen3-VL's "
                "interleaved mRoPE scales no positions; build the rotary module without it"
            )
        mode = "interleave" if self.rotary_interleaved else "half"
        inv_freq = self.inv_freq.to(position_ids.device)
        return mrope_angles(position_ids, inv_freq, list(mrope_section), rotary_mode=mode)
