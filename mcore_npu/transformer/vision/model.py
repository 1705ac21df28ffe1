"""Qwen3-VL on the NPU spec: the vision tower, then a GPT language model with interleaved mRoPE
and deepstack.

:class:`NPUQwen3VLModel` ``forward(input_ids [B, S], position_ids=None, attention_mask=None,
pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
packed_seq_params=None, labels=None)`` returns logits ``[B, S, V]`` (or Megatron's loss with
``labels``). The image / video tokens' embeddings are replaced by the tower's, in ``[B, S]``
row-major order as transformers' ``masked_scatter``; the deepstack features are added to those
tokens' hidden states after the first layers (one per deepstack block). ``position_ids`` None:
:func:`~mcore_npu.transformer.vision.positions.rope_index` (``attention_mask`` **True = token**).
Text only, it is the plain language model."""

from __future__ import annotations

import contextlib

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule

from mcore_npu.transformer.vision import positions
from mcore_npu.transformer.vision.mrope import InterleavedMultimodalRotaryEmbedding
from mcore_npu.transformer.vision.tower import NPUVisionTower


class DeepstackGPTModel(GPTModel):
    """Megatron's ``GPTModel`` (``position_embedding_type="mrope"``) whose angles interleave
    T/H/W as Qwen3-VL's; :meth:`deepstack` adds features after the first layers."""

    def __init__(self, config, transformer_layer_spec, vocab_size, max_sequence_length, **kwargs):
        kwargs["position_embedding_type"] = "mrope"
        super().__init__(config, transformer_layer_spec, vocab_size, max_sequence_length, **kwargs)
        self.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(
            kv_channels=config.kv_channels,
            rotary_percent=kwargs.get("rotary_percent", 1.0),
            rotary_interleaved=config.rotary_interleaved,
            rotary_base=kwargs.get("rotary_base", 10000),
        )

    @contextlib.contextmanager
    def deepstack(self, features: list[torch.Tensor], where: tuple[torch.Tensor, torch.Tensor]):
        """Within the block, layer ``i`` (global, from 0) adds ``features[i] [n, H]`` at the
        hidden rows ``where = (s_index, b_index)`` (``[n]`` each) of its output ``[S, B, H]``."""
        handles = []
        for layer in self.decoder.layers if self.decoder is not None else ():
            number = layer.layer_number - 1
            if number < len(features):
                add = _adder(features[number], where)
                handles.append(layer.register_forward_hook(add))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _adder(feature: torch.Tensor, where):
    def hook(module, args, output):
        hidden, context = output
        return torch.index_put(hidden, where, feature.to(hidden.dtype), accumulate=True), context

    return hook


class NPUQwen3VLModel(MegatronModule):
    """Qwen3-VL: ``vision`` (on the first pipeline stage, else None) and ``language_model``;
    ``image_token_id`` / ``video_token_id`` / ``spatial_merge_size``: the config's (every stage
    computes the positions)."""

    def __init__(
        self,
        language_model: DeepstackGPTModel,
        vision: NPUVisionTower | None,
        *,
        image_token_id: int,
        video_token_id: int,
        spatial_merge_size: int,
    ):
        super().__init__(config=language_model.config)
        self.language_model = language_model
        self.vision = vision
        self.image_token_id, self.video_token_id = image_token_id, video_token_id
        self.spatial_merge_size = spatial_merge_size
        self.pre_process = language_model.pre_process

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids,
        position_ids=None,
        attention_mask=None,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        packed_seq_params=None,
        labels=None,
        **kwargs,
    ):
        if position_ids is None:
            position_ids = positions.rope_index(
                input_ids,
                image_token_id=self.image_token_id,
                video_token_id=self.video_token_id,
                spatial_merge_size=self.spatial_merge_size,
                image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw,
                attention_mask=attention_mask,
            )
        if not self.pre_process:
            return self.language_model(
                input_ids,
                position_ids,
                attention_mask,
                labels=labels,
                packed_seq_params=packed_seq_params,
                **kwargs,
            )
        embeds = self.language_model.embedding(input_ids=input_ids, position_ids=None)  # [S, B, H]
        features, where = [], None
        for pixels, grid, token in (
            (pixel_values, image_grid_thw, self.image_token_id),
            (pixel_values_videos, video_grid_thw, self.video_token_id),
        ):
            if pixels is None:
                continue
            visual, deep = self._vision(pixels, grid)
            b, s = (input_ids == token).nonzero(as_tuple=True)  # [B, S] row-major
            self._check_count(len(b), visual.shape[0], token)
            embeds = torch.index_put(embeds, (s, b), visual.to(embeds.dtype))
            features, where = _joined(features, where, deep, (s, b))
        if _packs_itself(packed_seq_params, attention_mask):
            input_ids, position_ids, embeds, where = _pack(
                input_ids, position_ids, embeds, where, attention_mask, packed_seq_params
            )
            attention_mask = None
        stack = self.language_model.deepstack(features, where) if features else _nothing()
        with stack:
            return self.language_model(
                input_ids,
                position_ids,
                attention_mask,
                decoder_input=embeds,
                labels=labels,
                packed_seq_params=packed_seq_params,
                **kwargs,
            )

    def _vision(self, pixels, grid):
        if self.vision is None:
            raise ValueError(
                "pixel_values: given to a pipeline stage without the vision tower; pass images "
                "to the first stage (pre_process=True), which holds it"
            )
        return self.vision(pixels, grid)

    @staticmethod
    def _check_count(tokens: int, features: int, token: int) -> None:
        if tokens != features:
            raise ValueError(
                f"input_ids: {tokens} tokens of id {token} but the vision tower gave {features} "
                "features; pass the input_ids and grids the processor produced together"
            )


def _packs_itself(packed_seq_params, attention_mask) -> bool:
    """verl's thd call: padded ``[B, S]`` tokens, their mask and the packed description."""
    thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
    return thd and attention_mask is not None and attention_mask.dim() == 2


def _pack(input_ids, position_ids, embeds, where, attention_mask, params):
    """Row ``i``'s tokens (``attention_mask`` **True = token**) at ``cu_seqlens_q_padded[i]``,
    as verl's ``preprocess_packed_seqs`` packs them: ``([1, T], [3, 1, T], [T, 1, H], where)``."""
    starts = (
        params.cu_seqlens_q_padded
        if params.cu_seqlens_q_padded is not None
        else params.cu_seqlens_q
    )
    starts = starts.tolist()
    keep = attention_mask.bool()
    rows, cols = keep.nonzero(as_tuple=True)  # row-major: each row's tokens in order
    counts = keep.sum(-1).tolist()
    first = torch.tensor([s for s, n in zip(starts, counts) for _ in range(n)])
    within = torch.cat([torch.arange(n) for n in counts]) if counts else first
    slots = (first + within).to(input_ids.device)
    total = starts[-1]
    slot_of = torch.full_like(input_ids, -1)
    slot_of[rows, cols] = slots
    packed_ids = input_ids.new_zeros(1, total).index_put((slots * 0, slots), input_ids[rows, cols])
    packed_pos = position_ids.new_zeros(3, 1, total)
    packed_pos[:, 0, slots] = position_ids[:, rows, cols]
    hidden = embeds.new_zeros(total, 1, embeds.shape[-1])
    hidden = torch.index_put(hidden, (slots, slots * 0), embeds[cols, rows])
    if where is not None:
        s, b = where
        where = (slot_of[b, s], torch.zeros_like(s))
    return packed_ids, packed_pos, hidden, where


def _joined(features, where, deep, indices):
    """Deepstack features of images and videos together, rows matching ``where``."""
    if not features:
        return list(deep), indices
    joined = [torch.cat((a, b)) for a, b in zip(features, deep)]
    return joined, tuple(torch.cat((a, b)) for a, b in zip(where, indices))


@contextlib.contextmanager
def _nothing():
    yield
