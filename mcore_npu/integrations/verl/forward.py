"""The NPU engines' forward of one micro-batch: what verl's forwards hand the model, and when the
engine runs its own.

verl 0.9.1's Megatron engine (``forward_step``, ``verl/models/mcore/model_forward.py``) hands the
model, per micro-batch:

=================  ==========================================  ==================================
layout             off an NPU                                  on an NPU (``is_npu_available``)
=================  ==========================================  ==================================
bshd               ``[B, S]`` keep mask, True = real token     ``[B, 1, S, S]``, True = masked
                   (``preprocess_bshd_engine``)                (``_build_npu_attn_mask``: B·S²
                                                               bytes per micro-batch)
bshd, vision       ``[B, S]`` keep mask, no position ids       no mask, no position ids
                   (``build_vlm_attn_mask_bshd``)
thd                no mask, ``PackedSeqParams``                the same
thd, vision        ``[B, S]`` rows and keep mask with          the same
                   ``PackedSeqParams``, for a vision tower
                   to merge and pack
=================  ==========================================  ==================================

("vision": the checkpoint's config has ``vision_config``, as every Qwen3.5 hub checkpoint's.)
The model accepts each of them (``mcore_npu.masks.key_padding`` reads the ``[B, S]`` keep mask as
right padding under causal attention), but the engine runs its own forward where it can:

- **bshd** (``use_remove_padding=False``): verl right-pads every sequence, so under causal
  attention no real query ever sees a padded key; the model gets ``attention_mask=None`` and the
  operator runs with its causal ``sparse_mode`` and the cached 2048 x 2048 compressed mask. No
  ``[B, 1, S, S]`` tensor exists; the ``[B, S]`` keep mask (True = real token) only selects the
  real positions of the outputs (:class:`RightPadded`).
- **thd of a vision-language checkpoint**: the plugin builds its language model only, so the
  micro-batch goes through verl's own packed forward as for a language model
  (``vision_model=False``): packed ids, ``PackedSeqParams``, no mask.
- **thd** of a language model goes through verl's own forward unchanged; ``NPUFusionAttention``
  turns ``PackedSeqParams`` into the operator's TND layout. Nothing is read from or written to
  globals (verl's ``preprocess_for_mindspeed`` still runs on NPU; without MindSpeed installed
  it only logs that it skipped).

Under context parallelism the engine's bshd forward hands each rank its two chunks of every row
(Megatron's zigzag, as verl's ``preprocess_bshd_engine`` splits them) and gathers the outputs
back (:mod:`mcore_npu.integrations.verl.bshd`). Not with fused kernels, MTP, router replay or
top-k distillation: those run verl's own forward, whose extra inputs this one does not prepare; for a vision-language
checkpoint they are refused in one line (verl's vision forward expects a vision tower). A
micro-batch with images is refused in one line (:func:`refuse_images`).
"""

from __future__ import annotations

from functools import partial

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.utils.megatron_utils import unwrap_model
from verl.utils.torch_functional import expand_as_nested

from mcore_npu.integrations.verl.bshd import RightPadded, pad_right

__all__ = ["IMAGE_INPUTS", "LMHeadSteps", "ValueHeadSteps", "is_vision_config", "refuse_images"]


def is_vision_config(model_config) -> bool:
    """A vision-language checkpoint (verl's test: the config has ``vision_config``)."""
    return hasattr(model_config.hf_config, "vision_config")


IMAGE_INPUTS = ("pixel_values", "pixel_values_videos")


def refuse_images(batch, hf_config) -> None:
    """Refuse a micro-batch with images or videos: the plugin builds the language model of a
    vision-language checkpoint, not its vision tower.

    Raises:
        ValueError: ``multi_modal_inputs`` holds ``pixel_values`` or ``pixel_values_videos``.
    """
    from verl.utils.model import extract_multi_modal_inputs

    given = extract_multi_modal_inputs(batch.get("multi_modal_inputs", []))
    found = [key for key in IMAGE_INPUTS if key in given]
    if found:
        model_type = getattr(hf_config, "model_type", type(hf_config).__name__)
        raise ValueError(
            f"multi_modal_inputs: this micro-batch carries {', '.join(found)}, but the plugin "
            f"builds the language model of {model_type!r} only, not its vision tower; train it "
            "on text-only data (prompts without images), or use verl's own engine for "
            "vision-language training until the plugin builds the tower"
        )


class ForwardSteps:
    """The engines' ``forward_step``: verl's own, or the engine's ``_mask_free_step``."""

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        """verl's own ``forward_step`` unless this micro-batch takes the plugin's path
        (:meth:`_own_forward`); then the engine's ``_mask_free_step`` on the device batch."""
        batch = next(batch_iter)
        refuse_images(batch, self.model_config.hf_config)
        if not self._own_forward(batch):
            return super().forward_step(
                iter([batch]), model, logits_processor_func, postprocess_micro_batch_func
            )
        return self._mask_free_step(
            batch.to(get_device_id()), model, logits_processor_func, postprocess_micro_batch_func
        )

    def _mask_free_forward(self, model, batch):
        """One bshd forward without a mask tensor: ``(output, RightPadded, jagged input_ids)``.

        The jagged ``input_ids`` are right-padded to ``[B, S]`` (under context parallelism, this
        rank's two chunks of every row: ``[B, S/CP]``); right padding under causal attention
        needs no mask (no real query sees a pad key), so ``attention_mask=None`` and the
        operator's causal mode (the cached compressed mask) does the rest. ``output`` is this
        rank's.
        """
        input_ids = self.prepare_model_inputs(batch)["input_ids"]
        padded = pad_right(input_ids)
        local_ids, positions = padded.local(padded.pad(input_ids)), padded.local(padded.positions)
        output = model(input_ids=local_ids, attention_mask=None, position_ids=positions)
        return output, padded, input_ids

    def _own_forward(self, batch) -> bool:
        """True when this micro-batch runs the plugin's forward instead of verl's.

        That is bshd (``use_remove_padding=False``: verl would build a mask per micro-batch) and,
        for a vision-language checkpoint whose language model the plugin builds, thd too (verl's
        vision forward would hand it ``[B, S]`` rows and a mask; the batch has no images,
        :func:`refuse_images`), unless something only verl's forward prepares is on
        (:meth:`_verl_only`). A vision-language checkpoint with such a thing is refused.
        """
        vision = is_vision_config(self.model_config)
        if self.engine_config.use_remove_padding and not vision:
            return False
        reason = self._verl_only(batch)
        if reason is not None and vision:
            model_type = getattr(self.model_config.hf_config, "model_type", "?")
            raise ValueError(
                f"{reason}: not with the vision-language checkpoint {model_type!r}, whose "
                "language model the plugin builds: verl's vision forward, which prepares it, "
                "hands the model unpacked [B, S] rows for the vision tower to merge; turn it off"
            )
        return reason is None

    def _verl_only(self, batch) -> str | None:
        """What this micro-batch needs that only verl's own forward prepares, or None."""
        if self.engine_config.use_fused_kernels:
            return "use_fused_kernels=True"
        if self.enable_routing_replay:
            return "router replay"
        if self.model_config.mtp.enable:
            return "multi-token prediction (model.mtp.enable)"
        if tu.get_non_tensor_data(batch, key="distillation_use_topk", default=False):
            return "top-k distillation"
        return None

    def _packed_language_model(self, model, batch, **forward_kwargs):
        """verl's own forward (``get_mcore_engine_forward_fn``) in thd, as for a language model:
        ``vision_model=False``, so the model gets packed ids, ``PackedSeqParams`` and no mask."""
        from verl.models.mcore import get_mcore_engine_forward_fn

        forward_fn = get_mcore_engine_forward_fn(self.model_config.hf_config)
        bucket = (
            self.engine_config.pad_to_length_bucket if self.engine_config.pad_to_length else None
        )
        return forward_fn(
            model, batch["input_ids"], {}, vision_model=False, data_format="thd",
            pad_token_id=self.model_config.tokenizer.pad_token_id, pad_to_length_bucket=bucket,
            cp_layout=self._get_context_parallel_layout(unwrap_model(model)), **forward_kwargs,
        )  # fmt: skip


class LMHeadSteps(ForwardSteps):
    """The LM-head engine's own micro-batch forward."""

    def _mask_free_step(self, batch, model, logits_processor_func, postprocess_micro_batch_func):
        thd = self.engine_config.use_remove_padding
        done = partial(postprocess_micro_batch_func, data=batch, local_cp_size=None)
        processor = partial(
            self._lm_head_logits_processor,
            calculate_sum_pi_squared=tu.get_non_tensor_data(
                batch, key="calculate_sum_pi_squared", default=False
            ),
            calculate_entropy=tu.get_non_tensor_data(batch, key="calculate_entropy", default=False),
            distillation_use_topk=False,
            distillation_only=False,
            logits_processor_func=logits_processor_func,
            batch=batch,
            data_format="thd" if thd else "bshd",
        )
        if thd:  # verl's packed forward; its processor arguments as verl's forward_step makes them
            input_ids = batch["input_ids"]
            rows = self._row_temperature(batch, input_ids)
            args = {"label": input_ids.clone(), "temperature": expand_as_nested(rows, input_ids)}
            output = self._packed_language_model(
                model, batch, logits_processor=processor, logits_processor_args=args
            )
            return output, done
        logits, padded, input_ids = self._mask_free_forward(model, batch)
        if not unwrap_post_process(model):  # an earlier pipeline stage: hidden states go on
            return logits, done
        label = torch.roll(padded.pad(input_ids), shifts=-1, dims=1)  # next token, as verl rolls
        temperature = self._padded_temperature(batch, input_ids, padded)
        results = processor(logits, padded.local(label), padded.local(temperature))
        return {key: padded.unpad(padded.gather(value)) for key, value in results.items()}, done

    @staticmethod
    def _row_temperature(batch, input_ids) -> torch.Tensor:
        """``[B]`` float32: each row's sampling temperature (a scalar in the batch: every row's)."""
        temperature = batch["temperature"]
        if not isinstance(temperature, torch.Tensor):
            temperature = torch.tensor([temperature] * input_ids.shape[0])
        return temperature.to(device=input_ids.device, dtype=torch.float32)

    @classmethod
    def _padded_temperature(cls, batch, input_ids, padded: RightPadded) -> torch.Tensor:
        """``[B, S]`` float32: each row's temperature on every position (1.0 in the padding)."""
        rows = cls._row_temperature(batch, input_ids).to(padded.keep.device).reshape(-1, 1)
        return torch.where(padded.keep, rows, torch.ones_like(rows))


class ValueHeadSteps(ForwardSteps):
    """The value-head engine's own micro-batch forward."""

    def _mask_free_step(self, batch, model, logits_processor_func, postprocess_micro_batch_func):
        done = partial(postprocess_micro_batch_func, data=batch)
        if self.engine_config.use_remove_padding:
            values = self._packed_language_model(model, batch, value_model=True)
            return values, done
        values, padded, _ = self._mask_free_forward(model, batch)
        if unwrap_post_process(model):  # [B, j], as verl's value forward returns
            values = padded.unpad(padded.gather(values)).squeeze(-1)
        return values, done


def unwrap_post_process(model) -> bool:
    """Whether this model chunk holds the output layer (the last pipeline stage)."""
    return bool(unwrap_model(model).post_process)
