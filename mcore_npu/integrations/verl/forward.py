"""The NPU engines' forward of one micro-batch: verl's own, or the engine's where it can.

verl 0.9.1's forwards hand the model, per micro-batch: bshd, a ``[B, S]`` keep mask (**True =
real token**) off an NPU, a dense ``[B, 1, S, S]`` (**True = masked out**) on one; thd, no mask
and ``PackedSeqParams``; thd of a vision config, unpacked ``[B, S]`` rows and a keep mask for a
vision tower to merge. The model accepts each (``mcore_npu.masks.key_padding``), but the engine
runs its own forward for:

- **bshd**: verl right-pads, so under causal attention the model gets ``attention_mask=None``
  (the operator's causal mode); the keep mask only selects the real outputs (:class:`RightPadded`,
  split zigzag over CP ranks and gathered back, :mod:`.bshd`);
- **thd of a vision-language checkpoint whose language model only the plugin builds** (Qwen3.5's
  hub form): verl's packed forward as for a language model (``vision_model=False``).

Fused kernels, MTP, router replay and top-k distillation run verl's own forward (refused for
such a checkpoint, as is a micro-batch with images: :func:`refuse_images`). Qwen3-VL, whose
vision tower the plugin builds too, always runs verl's own vision forward.
"""

from __future__ import annotations

from functools import partial

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.utils.megatron_utils import unwrap_model
from verl.utils.torch_functional import expand_as_nested

from mcore_npu.integrations.verl.bshd import RightPadded, pad_right

__all__ = [
    "IMAGE_INPUTS",
    "LMHeadSteps",
    "ValueHeadSteps",
    "builds_vision_tower",
    "is_vision_config",
    "refuse_images",
]


def is_vision_config(model_config) -> bool:
    """A vision-language checkpoint (verl's test: the config has ``vision_config``)."""
    return hasattr(model_config.hf_config, "vision_config")


def builds_vision_tower(hf_config) -> bool:
    """Whether the plugin builds this checkpoint's vision tower too (Qwen3-VL): verl's own
    vision forward then runs unchanged, images included."""
    from mcore_npu.integrations.mbridge_fixes import QWEN3_VL_TYPES

    return getattr(hf_config, "model_type", None) in QWEN3_VL_TYPES


IMAGE_INPUTS = ("pixel_values", "pixel_values_videos")


def refuse_images(batch, hf_config) -> None:
    """Raise ``ValueError`` when ``multi_modal_inputs`` holds :data:`IMAGE_INPUTS` and the plugin
    builds the checkpoint's language model only (:func:`builds_vision_tower`)."""
    from verl.utils.model import extract_multi_modal_inputs

    if builds_vision_tower(hf_config):
        return
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

        The model gets ``[B, S]`` right-padded ids (``[B, S/CP]``: this CP rank's two chunks of
        every row) and ``attention_mask=None``: under causal attention no real query sees a pad
        key. ``output`` is this rank's.
        """
        input_ids = self.prepare_model_inputs(batch)["input_ids"]
        padded = pad_right(input_ids)
        local_ids, positions = padded.local(padded.pad(input_ids)), padded.local(padded.positions)
        output = model(input_ids=local_ids, attention_mask=None, position_ids=positions)
        return output, padded, input_ids

    def _own_forward(self, batch) -> bool:
        """True when this micro-batch runs the plugin's forward: bshd, and thd of a
        vision-language checkpoint, unless :meth:`_verl_only` says otherwise (refused for a
        vision-language checkpoint)."""
        vision = is_vision_config(self.model_config)
        if builds_vision_tower(self.model_config.hf_config):
            return False  # verl's vision forward: the model takes images, masks and packs
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
        config = self.engine_config
        bucket = config.pad_to_length_bucket if config.pad_to_length else None
        pad_id = self.model_config.tokenizer.pad_token_id
        layout = self._get_context_parallel_layout(unwrap_model(model))
        return forward_fn(
            model,
            batch["input_ids"],
            {},
            vision_model=False,
            data_format="thd",
            pad_token_id=pad_id,
            pad_to_length_bucket=bucket,
            cp_layout=layout,
            **forward_kwargs,
        )


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
