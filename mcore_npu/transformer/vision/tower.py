"""Qwen3-VL's vision tower as Megatron modules on the NPU spec.

``pixel_values [P, C·t·p·p]`` (the processor's flattened patches, each ``m x m`` block of a frame
contiguous) and ``grid_thw [n, 3]`` (t, h, w in patches per image / video) go through:

- ``patch_embed.proj``: the Conv3d of transformers' checkpoint (``[H, C, t, p, p]``), computed as
  one matmul (a stride-equals-kernel convolution over one patch is a linear map);
- ``pos_embed``: the learned ``side x side`` table, bilinearly interpolated to each grid;
- ``blocks``: Megatron ``TransformerLayer``s from ``get_gpt_layer_npu_spec`` (LayerNorm, biased
  linears, GELU-tanh MLP, TE parameter names), full attention per frame in packed thd (TND through
  ``npu_fusion_attention``, no dense mask), 2D RoPE (row, col) through the fused RoPE path;
- ``merger`` and ``deepstack_merger_list``: LayerNorm, ``m²·H -> m²·H -> out`` MLPs (exact GELU).

Returns ``(embeds [P/m², out], [deepstack [P/m², out] per deepstack block])``. The blocks are
split by TP as Megatron splits a transformer; the embeddings and mergers are replicated; every
context-parallel rank runs the whole tower."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec
from mcore_npu.transformer.vision import positions


@dataclass(frozen=True)
class VisionShape:
    """What the vision tower adds to its blocks' ``TransformerConfig``."""

    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    out_hidden_size: int
    deepstack_visual_indexes: tuple[int, ...] = ()

    def __post_init__(self):
        side = int(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(
                f"num_position_embeddings: {self.num_position_embeddings} is not a square; the "
                "learned position table is side x side (Qwen3-VL: 48 x 48 = 2304)"
            )


def vision_block_spec(kernel: str = "auto"):
    """One vision block: the NPU GPT layer (TE names, LayerNorm) attending without a mask, its
    2D RoPE through the plugin's ``rotary_mul`` (which reads CP from the block's groups: none)."""
    spec = get_gpt_layer_npu_spec(kernel=kernel, param_layout="te", normalization="LayerNorm",
                                  rope_kernel=kernel)  # fmt: skip
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.no_mask
    return spec


def _without_context_parallelism(pg_collection):
    """The blocks' process groups: ``pg_collection`` (None: parallel_state's) with no CP group.
    Every context-parallel rank runs the whole tower on all the frames; the language model's
    tokens are what CP splits."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = copy.copy(pg_collection or ProcessGroupCollection.use_mpu_process_groups())
    groups.cp = None
    return groups


class PatchEmbed(torch.nn.Module):
    """``patch_embed.proj``: ``[P, C·t·p·p] -> [P, H]`` with the Conv3d's parameters."""

    def __init__(self, shape: VisionShape, hidden: int, dtype):
        super().__init__()
        kernel = (shape.temporal_patch_size, shape.patch_size, shape.patch_size)
        self.proj = torch.nn.Conv3d(shape.in_channels, hidden, kernel, stride=kernel, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        patches = pixel_values.reshape(-1, weight[0].numel()).to(weight.dtype)
        return F.linear(patches, weight.flatten(1), self.proj.bias)


class PatchMerger(torch.nn.Module):
    """``m x m`` patches -> one token: norm (of each patch, or of the merged ``m²·H`` vector for
    the deepstack mergers), then ``linear_fc1``, GELU, ``linear_fc2``."""

    def __init__(self, hidden: int, merge: int, out: int, *, postshuffle: bool, dtype):
        super().__init__()
        self.merged = hidden * merge * merge
        self.postshuffle = postshuffle
        self.norm = torch.nn.LayerNorm(
            self.merged if postshuffle else hidden, eps=1e-6, dtype=dtype
        )
        self.linear_fc1 = torch.nn.Linear(self.merged, self.merged, dtype=dtype)
        self.linear_fc2 = torch.nn.Linear(self.merged, out, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.merged) if self.postshuffle else x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.reshape(-1, self.merged))))


class NPUVisionTower(MegatronModule):
    """Qwen3-VL's vision model; ``config``: the blocks' ``TransformerConfig`` (LayerNorm, eps
    1e-6, biases, GELU-tanh, ``num_layers`` = depth), ``shape``: the rest."""

    def __init__(self, config, shape: VisionShape, *, kernel: str = "auto", pg_collection=None):
        super().__init__(config=config)
        if getattr(config, "sequence_parallel", False):
            raise ValueError(
                "sequence_parallel: True for the vision tower; its frames are short and packed "
                "one after another: build the vision config with sequence_parallel=False"
            )
        self.shape = shape
        dtype, hidden = config.params_dtype, config.hidden_size
        self.side = int(shape.num_position_embeddings**0.5)
        self.patch_embed = PatchEmbed(shape, hidden, dtype)
        self.pos_embed = torch.nn.Embedding(shape.num_position_embeddings, hidden, dtype=dtype)
        head_dim = hidden // config.num_attention_heads
        quarter = head_dim // 2  # (row, col) each drive head_dim / 4 frequencies
        self.inv_freq = 1.0 / (
            10000.0 ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)
        )
        spec = vision_block_spec(kernel)
        groups = _without_context_parallelism(pg_collection)
        self.blocks = torch.nn.ModuleList(
            build_module(spec, config=config, layer_number=i + 1, pg_collection=groups)
            for i in range(config.num_layers)
        )
        merge, out = shape.spatial_merge_size, shape.out_hidden_size
        self.merger = PatchMerger(hidden, merge, out, postshuffle=False, dtype=dtype)
        self.deepstack_merger_list = torch.nn.ModuleList(
            PatchMerger(hidden, merge, out, postshuffle=True, dtype=dtype)
            for _ in shape.deepstack_visual_indexes
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """``(embeds [P/m², out], deepstack list)`` for ``pixel_values [P, C·t·p·p]``."""
        merge = self.shape.spatial_merge_size
        x = self.patch_embed(pixel_values)
        index, weight = positions.bilinear_corners(grid_thw, self.side, merge)
        x = x + (self.pos_embed(index) * weight.to(x.dtype)[..., None]).sum(0)
        angles = self._angles(positions.patch_positions(grid_thw, merge))
        cu = positions.frame_cu_seqlens(grid_thw).to(x.device)
        longest = int((cu[1:] - cu[:-1]).max())
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        hidden, deepstack = x.unsqueeze(1), []  # [P, 1, H]
        for number, block in enumerate(self.blocks):
            hidden = self._block(block, hidden, angles, packed)
            if number in self.shape.deepstack_visual_indexes:
                which = self.shape.deepstack_visual_indexes.index(number)
                deepstack.append(self.deepstack_merger_list[which](hidden.squeeze(1)))
        return self.merger(hidden.squeeze(1)), deepstack

    def _angles(self, rows_cols: torch.Tensor) -> torch.Tensor:
        """``[P, 1, 1, head_dim]`` fp32: (row, col) frequencies, twice (rotate-half)."""
        inv_freq = self.inv_freq.to(rows_cols.device)
        freqs = (rows_cols[..., None].float() * inv_freq).flatten(1)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    def _block(self, block, hidden, angles, packed):
        def run(h):
            return block(
                hidden_states=h,
                attention_mask=None,
                rotary_pos_emb=angles,
                packed_seq_params=packed,
            )[0]

        if self.config.recompute_granularity == "full" and self.training:
            return tensor_parallel.checkpoint(run, self.config.distribute_saved_activations, hidden)
        return run(hidden)
