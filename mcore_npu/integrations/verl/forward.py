"""The NPU engines' forward of one micro-batch: verl's own, or the engine's where it can.

verl 0.9.1's forwards hand the model, per micro-batch: bshd, a ``[B, S]`` keep mask (**True =
real token**) off an NPU, a dense ``[B, 1, S, S]`` (**True = masked out**) on one; thd, no mask
and ``PackedSeqParams``; thd of a vision config, unpacked ``[B, S]`` rows and a keep mask for the
vision tower to merge. The model accepts each (``mcore_npu.masks.key_padding``), but the engine
runs its own forward for a **bshd micro-batch without images**: verl right-pads, so under causal
attention the model gets ``attention_mask=None`` (the operator's causal mode); the keep mask only
selects the real outputs (:class:`RightPadded`, split zigzag over CP ranks and gathered back,
:mod:`.bshd`; router replay's routes in its token order, :func:`.replay.bshd_replay`). Images
(Qwen3-VL, Qwen3.5's hub form), fused kernels, MTP and top-k distillation run verl's own forward.
"""

from __future__ import annotations

from functools import partial

import torch
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id
from verl.utils.megatron_utils import unwrap_model

from mcore_npu.integrations.verl.bshd import RightPadded, pad_right
from mcore_npu.integrations.verl.replay import bshd_replay

__all__ = ["IMAGE_INPUTS", "LMHeadSteps", "ValueHeadSteps", "carries_images"]

IMAGE_INPUTS = ("pixel_values", "pixel_values_videos")


def carries_images(batch) -> bool:
    """Whether the micro-batch's ``multi_modal_inputs`` hold :data:`IMAGE_INPUTS`."""
    from verl.utils.model import extract_multi_modal_inputs

    given = extract_multi_modal_inputs(batch.get("multi_modal_inputs", []))
    return any(key in given for key in IMAGE_INPUTS)


class ForwardSteps:
    """The engines' ``forward_step``: verl's own, or the engine's ``_mask_free_step``."""

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        """verl's own ``forward_step`` unless this micro-batch takes the plugin's path
        (:meth:`_own_forward`); then the engine's ``_mask_free_step`` on the device batch."""
        batch = next(batch_iter)
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
        every row), their positions and ``attention_mask=None``: under causal attention no real
        query sees a pad key. ``output`` is this rank's.
        """
        input_ids = self.prepare_model_inputs(batch)["input_ids"]
        padded = pad_right(input_ids)
        local_ids, positions = padded.local(padded.pad(input_ids)), padded.local(padded.positions)
        with bshd_replay(self, model, batch, padded):
            output = model(input_ids=local_ids, attention_mask=None, position_ids=positions)
        return output, padded, input_ids

    def _own_forward(self, batch) -> bool:
        """True when this micro-batch runs the plugin's forward: bshd, no images, nothing
        :meth:`_verl_only` names."""
        if self.engine_config.use_remove_padding:
            return False
        reason = "images" if carries_images(batch) else self._verl_only(batch)
        if reason is not None and self.enable_routing_replay:
            raise ValueError(
                f"router replay in bshd (use_remove_padding=False) with {reason}: verl's forward "
                "for it lays routes out as thd: set use_remove_padding=True"
            )
        return reason is None

    def _verl_only(self, batch) -> str | None:
        """What this micro-batch needs that only verl's own forward prepares, or None."""
        if self.engine_config.use_fused_kernels:
            return "use_fused_kernels=True"
        if self.model_config.mtp.enable:
            return "multi-token prediction (model.mtp.enable)"
        if tu.get_non_tensor_data(batch, key="distillation_use_topk", default=False):
            return "top-k distillation"
        return None


class LMHeadSteps(ForwardSteps):
    """The LM-head engine's own micro-batch forward."""

    def _mask_free_step(self, batch, model, logits_processor_func, postprocess_micro_batch_func):
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
            data_format="bshd",
        )
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
        values, padded, _ = self._mask_free_forward(model, batch)
        if unwrap_post_process(model):  # [B, j], as verl's value forward returns
            values = padded.unpad(padded.gather(values)).squeeze(-1)
        return values, done


def unwrap_post_process(model) -> bool:
    """Whether this model chunk holds the output layer (the last pipeline stage)."""
    return bool(unwrap_model(model).post_process)
