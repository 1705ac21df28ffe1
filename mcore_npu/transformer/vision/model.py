"""Qwen3-VL (and Qwen3.5's hub form) on the NPU spec: the vision tower, then a GPT language model
(Qwen3.5: the Gated DeltaNet hybrid) with interleaved mRoPE and deepstack (Qwen3.5: none).

:class:`NPUQwen3VLModel` ``forward(input_ids [B, S], position_ids=None, attention_mask=None,
pixel_values=None, image_grid_thw=None, pixel_values_videos=None, video_grid_thw=None,
packed_seq_params=None, labels=None)`` returns logits ``[B, S, V]`` (or Megatron's loss with
``labels``). The image / video tokens' embeddings are replaced by the tower's, in ``[B, S]``
row-major order as transformers' ``masked_scatter``; the deepstack features are added to those
tokens' hidden states after the first layers (one per deepstack block). ``position_ids`` None:
:func:`~mcore_npu.transformer.vision.positions.rope_index` (``attention_mask`` **True = token**).
``position_ids [B, S]`` (text) are read as the same position on all three axes. Text only, it is
the plain language model."""

from __future__ import annotations

import contextlib
import functools

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule

from mcore_npu.transformer.vision import positions
from mcore_npu.transformer.vision.mrope import InterleavedMultimodalRotaryEmbedding
from mcore_npu.transformer.vision.packing import PackPlan, packs_itself
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

    def place(self, hidden, rows, values, *, accumulate: bool) -> torch.Tensor:
        """``hidden [S, B, H]`` with ``values [n, H]`` written (or added) at ``rows = (s, b)``
        (``[n]`` each, this CP rank's; -1 for another's); under sequence parallelism only this
        rank's rows, shifted, and the values' gradient summed over the TP group (each rank saw
        only its rows)."""
        keep = rows[0] >= 0  # -1: a token another context-parallel rank holds
        (s, b), values = (rows[0][keep], rows[1][keep]), values[keep]
        if self.config.sequence_parallel:
            # every rank holds all the values; each uses its rows, so the gradients are summed
            values = tensor_parallel.copy_to_tensor_model_parallel_region(values)
            local = hidden.shape[0]
            first = local * self.pg_collection.tp.rank()
            keep = (s >= first) & (s < first + local)
            s, b, values = s[keep] - first, b[keep], values[keep]
        return torch.index_put(hidden, (s, b), values.to(hidden.dtype), accumulate=accumulate)

    @contextlib.contextmanager
    def deepstack(self, features: list[torch.Tensor], rows: tuple[torch.Tensor, torch.Tensor]):
        """Within the block, layer ``i`` (global, from 0) adds ``features[i] [n, H]`` at
        ``rows = (s, b)`` of its output ``[S, B, H]`` (:meth:`place`)."""
        handles = []
        for layer in self.decoder.layers if self.decoder is not None else ():
            number = layer.layer_number - 1
            if number < len(features):
                hook = functools.partial(_add_feature, self, features[number], rows)
                handles.append(layer.register_forward_hook(hook))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _add_feature(model, feature, rows, module, args, output):
    hidden, context = output
    return model.place(hidden, rows, feature, accumulate=True), context


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
        self.post_process = language_model.post_process
        self.share_embeddings_and_output_weights = (
            language_model.share_embeddings_and_output_weights
        )

    def shared_embedding_or_output_weight(self):
        """The language model's tied weight (Megatron's gradient finalisation asks for it)."""
        return self.language_model.shared_embedding_or_output_weight()

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
        images = pixel_values is not None or pixel_values_videos is not None
        plan = self._plan(packed_seq_params, attention_mask, position_ids, images)
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
        elif position_ids.dim() == 2:  # text positions [B, S]: the same on all three axes
            position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        ids = plan.ids(input_ids) if plan else input_ids
        where_to = dict(
            position_ids=plan.positions(position_ids) if plan else position_ids,
            attention_mask=None if plan else attention_mask,
            labels=labels,
            packed_seq_params=packed_seq_params,
            **kwargs,
        )
        lm = self.language_model
        if not self.pre_process:
            return lm(ids, **where_to)
        embeds = lm.embedding(input_ids=ids, position_ids=None)  # [S, B, H] ([S/TP, ...] SP)
        visual = (
            (pixel_values, image_grid_thw, self.image_token_id),
            (pixel_values_videos, video_grid_thw, self.video_token_id),
        )
        features, where = [], None
        for pixels, grid, token in visual:
            if pixels is None:
                continue
            merged, deep = self._vision(pixels, grid)
            b, s = (input_ids == token).nonzero(as_tuple=True)  # [B, S] row-major
            self._check_count(len(b), merged.shape[0], token)
            rows = plan.where(b, s) if plan else (s, b)
            embeds = lm.place(embeds, rows, merged, accumulate=False)
            features, where = _joined(features, where, deep, rows)
        with lm.deepstack(features, where) if features else contextlib.nullcontext():
            return lm(ids, decoder_input=embeds, **where_to)

    def _plan(self, packed_seq_params, attention_mask, position_ids, images) -> PackPlan | None:
        """verl's thd call packs here (this CP rank's chunks). bshd under CP: only text rows
        already split (this rank's, with their positions and no mask, as ``GPTModel`` takes
        them); whole rows, or images, are refused."""
        cp = self.language_model.pg_collection.cp
        size, rank = (cp.size(), cp.rank()) if cp is not None else (1, 0)
        if packs_itself(packed_seq_params, attention_mask):
            return PackPlan(attention_mask, packed_seq_params, size, rank)
        if size > 1 and (images or attention_mask is not None or position_ids is None):
            raise ValueError(
                f"context_parallel_size: {size} with unpacked (bshd) rows holding images or a "
                "mask; the model splits packed batches only: use thd (use_remove_padding=True) "
                "under CP, or pass text rows already split, with position_ids and no mask"
            )
        return None

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


def _joined(features, where, deep, rows):
    """Deepstack features of images and videos together, rows matching ``where``."""
    if not features:
        return list(deep), rows
    joined = [torch.cat((a, b)) for a, b in zip(features, deep)]
    return joined, tuple(torch.cat((a, b)) for a, b in zip(where, rows))
