"""The plugin's mbridge bridge for Qwen3-VL (``model_type: qwen3_vl``): the vision tower and the
deepstack language model of ``mcore_npu.transformer.vision`` from the NPU spec.

:class:`Qwen3VLBridge`, an ``LLMBridge`` registered with mbridge's ``register_model``, builds the
language config from ``text_config`` (verl's overrides apply to it) and a vision config with the
same tensor parallelism (no sequence parallelism). Names and tensors come from
:mod:`.hf_qwen3_vl_weights`' one map; mbridge's own loader and exporter split and merge them over TP
(the vision ``qkv`` per head, the non-gated vision ``linear_fc1`` by rows). The vision tower is
on the first pipeline stage. :class:`VisionTowerBridge` is what it shares with Qwen3.5's hub-form
bridge (:mod:`.hf_qwen3_5_vl`)."""

from __future__ import annotations

from mbridge.core import LLMBridge, register_model
from mbridge.core.util import unwrap_model

from mcore_npu.integrations import hf_qwen3_vl as configs
from mcore_npu.integrations import hf_qwen3_vl_weights as names
from mcore_npu.integrations.bridge_provider import model_provider
from mcore_npu.integrations.hf_qwen3_5 import SlicingSafeTensorIO, collect_fused_expert
from mcore_npu.integrations.mbridge_fixes import QWEN3_VL_TYPES, mbridge_expert_form

MODEL_TYPES = QWEN3_VL_TYPES


class VisionTowerBridge:
    """What the bridges of a vision tower and a deepstack language model share (Qwen3-VL, the
    Qwen3.5 hub form): the vision config, the model provider, the local -> global names and the
    vision tensors' TP split. A subclass gives :meth:`_rope_args`."""

    own_npu_spec = True  # hf.use_npu_spec / the verl engine hand over the kernel and keywords
    npu_spec_keywords: dict = {}  # the NPU engine's recipe spec keywords (replaced, not mutated)
    npu_kernel = "auto"
    _vision_config = None  # (the language config it was made from, the vision config)

    def vision_config(self):
        """The vision tower's config: the language config's dtype, TP and recompute, no SP (made
        once per language config: the loader asks for it per vision tensor)."""
        config = self.config
        if self._vision_config is None or self._vision_config[0] is not config:
            vision = configs.vision_config(
                self.hf_config.vision_config,
                dtype=config.params_dtype,
                tensor_model_parallel_size=config.tensor_model_parallel_size,
                use_cpu_initialization=config.use_cpu_initialization,
                recompute_granularity=config.recompute_granularity,
                recompute_method=config.recompute_method,
                recompute_num_layers=config.recompute_num_layers,
            )
            self._vision_config = (config, vision)
        return self._vision_config[1]

    def _rope_args(self) -> dict:
        """``rotary_base`` and ``rotary_percent`` of the language model."""
        raise NotImplementedError

    def _model_provider(self, post_model_creation_callbacks):
        def build(pre_process, post_process, vp_stage):
            keywords = {**mbridge_expert_form(self.config), **self.npu_spec_keywords}
            spec = configs.language_spec(
                self.config, kernel=self.npu_kernel, vp_stage=vp_stage, **keywords
            )
            return configs.vision_language_model(
                self.hf_config, self.config, self.vision_config(), spec,
                kernel=self.npu_kernel, pre_process=pre_process, post_process=post_process,
                vp_stage=vp_stage, **self._rope_args(),
            )  # fmt: skip

        return model_provider(self, build, post_model_creation_callbacks)

    def _get_mcore_config_by_name(self, mcore_weights_name: str):
        return self.vision_config() if mcore_weights_name.startswith("vision.") else self.config

    def _weight_name_mapping_mcore_local_to_global(self, model, consider_ep: bool = True):
        """Local names -> global ones: the language layers renumbered by their global number,
        under EP the experts by theirs."""
        model = unwrap_model(model)
        decoder = model.language_model.decoder
        numbers = {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)}
        per_rank = (self.config.num_moe_experts or 0) // max(self.mpu.ep_size, 1)
        first_expert = per_rank * self.mpu.ep_rank if consider_ep else 0
        prefix = "language_model.decoder.layers."
        mapping = {}
        for name in model.state_dict():
            if "_extra_state" in name:
                continue
            if name.startswith(prefix):
                local, rest = name[len(prefix) :].split(".", 1)
                rest = _global_expert(rest, first_expert)
                mapping[name] = f"{prefix}{numbers[int(local)]}.{rest}"
            else:
                mapping[name] = name
        return mapping

    def _weight_split_across_tp(self, mcore_weights_name, mcore_weights, param, tp_split_size):
        """mbridge's split for Megatron's parallel linears; the tower's embeddings and mergers
        (plain torch modules) are whole on every rank."""
        if (
            not getattr(param, "tensor_model_parallel", False)
            and param.shape == mcore_weights.shape
        ):
            return [mcore_weights] * tp_split_size
        return super()._weight_split_across_tp(
            mcore_weights_name, mcore_weights, param, tp_split_size
        )


@register_model(list(MODEL_TYPES))
class Qwen3VLBridge(VisionTowerBridge, LLMBridge):
    """mbridge bridge for ``qwen3_vl`` and ``qwen3_vl_moe``; the experts' layout read last
    (``"transformers"`` or ``"hub"``) is the one export writes."""

    def __init__(self, hf_config, *args, **kwargs):
        self.shapes = names.Shapes.of(hf_config)
        self.expert_layout = "transformers"
        self._expert_buffer: dict = {}
        super().__init__(hf_config, *args, **kwargs)

    def _build_config(self):
        keywords = configs.language_keywords(self.hf_config)
        return self._build_base_config(text_config_key="text_config", **keywords)

    def _rope_args(self) -> dict:
        return configs.rope_args(self.hf_config)

    def _get_safetensor_io(self, weights_path: str):
        return SlicingSafeTensorIO(self._get_actual_hf_path(weights_path))  # "name[e]": a row

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        return names.hf_names(mcore_weights_name)

    def _weight_to_mcore_format(self, mcore_weights_name, hf_weights):
        if self.dtype is not None:
            hf_weights = [w.to(self.dtype) for w in hf_weights]
        expert = names.expert_shape(mcore_weights_name, self.shapes)
        if expert is not None and tuple(hf_weights[0].shape) != expert:
            self.expert_layout = "hub"
        elif expert is not None:
            self.expert_layout = "transformers"
        return names.to_mcore(mcore_weights_name, hf_weights, self.shapes)

    def _weight_to_hf_format(self, mcore_weights_name, mcore_weights):
        hf = names.hf_names(mcore_weights_name)
        tensors = names.to_hf(mcore_weights_name, mcore_weights, self.shapes)
        sliced = names.fused_row(hf[0])
        if sliced is None:
            return hf, tensors
        fused, e = sliced
        count = self.config.num_moe_experts
        out_names, out = collect_fused_expert(self._expert_buffer, fused, e, tensors[0], count)
        if self.expert_layout == "hub":
            out = [t.transpose(1, 2).contiguous() for t in out]
        return out_names, out

    def _get_hf_shared_weight_keys(self):
        if getattr(self.hf_config, "tie_word_embeddings", False):
            return [f"{names.TEXT_PREFIX}embed_tokens.weight"]
        return []


def _global_expert(rest: str, first: int) -> str:
    """``mlp.experts.linear_fc1.weight{e}`` with this EP rank's first expert added to ``e``."""
    head, sep, local = rest.rpartition(".weight")
    if not first or not sep or ".mlp.experts.linear_fc" not in f".{head}" or not local.isdigit():
        return rest
    return f"{head}.weight{int(local) + first}"
