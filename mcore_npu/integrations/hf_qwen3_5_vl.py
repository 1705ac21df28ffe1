"""The plugin's mbridge bridge for Qwen3.5's hub form (``model_type: qwen3_5`` / ``qwen3_5_moe``,
``Qwen3_5(Moe)ForConditionalGeneration``): the vision tower and the Gated DeltaNet hybrid
language model, with interleaved mRoPE, as one :class:`~mcore_npu.transformer.vision.model.
NPUQwen3VLModel`.

:class:`Qwen3_5VLBridge` is the language bridge of :mod:`.hf_qwen3_5` for ``language_model.*``
(its names under ``model.language_model.``) and Qwen3-VL's vision map (:mod:`.hf_qwen3_vl_weights`)
for ``vision.*`` (``model.visual.*``: Qwen3-VL's tower without deepstack). The MTP layers
(``mtp.*``) are not built."""

from __future__ import annotations

import logging

from mbridge.core import register_model

from mcore_npu.integrations import hf_qwen3_vl_weights as vision_names
from mcore_npu.integrations.hf_qwen3_5 import Qwen3_5Bridge, rope_keywords
from mcore_npu.integrations.hf_qwen3_vl_bridge import VisionTowerBridge
from mcore_npu.integrations.mbridge_fixes import QWEN3_5_HUB_TYPES

logger = logging.getLogger(__name__)

MODEL_TYPES = QWEN3_5_HUB_TYPES
_LANGUAGE = "language_model."


@register_model(list(MODEL_TYPES))
class Qwen3_5VLBridge(VisionTowerBridge, Qwen3_5Bridge):
    """mbridge bridge for Qwen3.5's hub checkpoints, vision tower included."""

    def __init__(self, hf_config, *args, **kwargs):
        self.shapes = vision_names.Shapes.of(hf_config)
        super().__init__(hf_config, *args, **kwargs)
        if getattr(self.text, "mtp_num_hidden_layers", 0):
            logger.warning(
                "%s: the vision tower and the language model are built and trained; the MTP "
                "layers (mtp.*) are not",
                hf_config.model_type,
            )

    def _build_config(self):
        config = super()._build_config()
        rope = dict(getattr(self.text, "rope_parameters", None) or {})
        config.mrope_section = list(rope.get("mrope_section", (11, 11, 10)))
        return config

    def _rope_args(self) -> dict:
        return rope_keywords(self.text)

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        if mcore_weights_name.startswith("vision."):
            return vision_names.hf_names(mcore_weights_name)
        return super()._weight_name_mapping_mcore_to_hf(_language(mcore_weights_name))

    def _weight_to_mcore_format(self, mcore_weights_name: str, hf_weights):
        if not mcore_weights_name.startswith("vision."):
            return super()._weight_to_mcore_format(mcore_weights_name, hf_weights)
        if self.dtype is not None:
            hf_weights = [w.to(self.dtype) for w in hf_weights]
        return vision_names.to_mcore(mcore_weights_name, hf_weights, self.shapes)

    def _weight_to_hf_format(self, mcore_weights_name: str, mcore_weights):
        if not mcore_weights_name.startswith("vision."):
            return super()._weight_to_hf_format(mcore_weights_name, mcore_weights)
        hf = vision_names.hf_names(mcore_weights_name)
        return hf, vision_names.to_hf(mcore_weights_name, mcore_weights, self.shapes)


def _language(name: str) -> str:
    """The language model's own name (``decoder.layers.…``) of ``language_model.…``."""
    if not name.startswith(_LANGUAGE):
        raise ValueError(
            f"{name}: neither vision.* nor language_model.*; build the model through "
            "Qwen3_5VLBridge (hf.npu_bridge / hf.build_model)"
        )
    return name[len(_LANGUAGE) :]
