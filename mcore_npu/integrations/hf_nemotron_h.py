"""The plugin's mbridge bridge for Nemotron-H (``model_type: nemotron_h``), Mamba2 hybrids.

:class:`NemotronHBridge`, an ``LLMBridge`` registered with mbridge's ``register_model``, reads
``config.json`` only and builds Megatron's hybrid model (``MambaModel`` / ``HybridModel``) from
``get_hybrid_stack_npu_spec``, one layer per Hugging Face block: ``M`` Mamba2, ``*`` attention
(no RoPE), ``-`` squared-ReLU MLP; ``E`` (MoE) is refused. Each block's ``norm`` is the fused
``layer_norm_weight`` of the layer's first projection. ``in_proj`` rows ``[z | x | B | C | dt]``
and ``conv1d`` rows ``[x | B | C]`` are split per section over TP. Every tensor is moved, never
changed, so export is bit-exact. The weight map: docs/mamba_hf.md.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import re

import torch
from mbridge.core import LLMBridge, register_model
from megatron.core.activations import squared_relu

from mcore_npu.integrations.bridge_provider import model_provider
from mcore_npu.integrations.mbridge_fixes import NEMOTRON_H_TYPES

logger = logging.getLogger(__name__)

MODEL_TYPES = NEMOTRON_H_TYPES
PREFIXES = ("backbone.", "model.")  # the checkpoint's names; transformers 5.25 writes backbone.
MIXER_NORM_EPS = 1e-5  # NPUMambaMixer's gated RMSNorm (Megatron's MambaMixer: fixed 1e-5)
# Hugging Face layer kind (5.25's names and the older ones) -> Megatron's pattern symbol
LAYER_SYMBOLS = {
    "linear_attention": "M",
    "mamba": "M",
    "full_attention": "*",
    "attention": "*",
    "mlp": "-",
    "moe": "E",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_SECTIONED = re.compile(r"mixer\.(in_proj\.weight|conv1d\.weight|conv1d\.bias)$")


def hybrid_pattern(hf_config) -> str:
    """Megatron's hybrid pattern (``M``, ``*``, ``-``) from ``layers_block_type``; ``ValueError``
    for MoE layers (``E``) and unknown kinds."""
    kinds = list(getattr(hf_config, "layers_block_type", None) or [])
    if not kinds:
        raise ValueError(
            "layers_block_type: empty; a Nemotron-H config names each layer's kind "
            "(or gives hybrid_override_pattern)"
        )
    unknown = sorted({kind for kind in kinds if kind not in LAYER_SYMBOLS})
    if unknown:
        raise ValueError(
            f"layers_block_type: {unknown} are not Nemotron-H layer kinds (those: "
            f"{', '.join(LAYER_SYMBOLS)})"
        )
    pattern = "".join(LAYER_SYMBOLS[kind] for kind in kinds)
    moe = [i for i, symbol in enumerate(pattern) if symbol == "E"]
    if moe:
        raise ValueError(
            f"layers_block_type: 'moe' (E) at layers {moe}; the Nemotron-H bridge builds Mamba "
            "(M), attention (*) and MLP (-) layers only, not Nemotron-H's sigmoid-routed "
            "non-gated experts; use a checkpoint without MoE layers"
        )
    return pattern


def _refuse(field: str, value, why: str) -> None:
    raise ValueError(f"{field}: {value!r}; {why}")


def check_supported(hf_config) -> None:
    """``ValueError`` naming the field for what the hybrid model cannot hold or compute."""
    h = hf_config
    if getattr(h, "use_bias", False):
        _refuse("use_bias", True, "Megatron's MambaMixer has no in_proj / out_proj bias")
    if getattr(h, "mlp_bias", False):
        _refuse("mlp_bias", True, "the bridge builds the MLP layers without biases")
    if getattr(h, "mlp_hidden_act", "relu2") != "relu2":
        _refuse("mlp_hidden_act", h.mlp_hidden_act, "the bridge builds squared ReLU ('relu2')")
    if getattr(h, "mamba_hidden_act", "silu") != "silu":
        _refuse("mamba_hidden_act", h.mamba_hidden_act, "Megatron's MambaMixer applies SiLU")
    limit = tuple(float(v) for v in getattr(h, "time_step_limit", None) or (0.0, math.inf))
    if limit != (0.0, math.inf):
        _refuse("time_step_limit", limit, "Megatron's MambaMixer does not clamp dt: (0.0, inf)")
    eps = float(h.layer_norm_epsilon)
    if eps != MIXER_NORM_EPS:
        _refuse(
            "layer_norm_epsilon",
            eps,
            f"transformers uses it for the Mamba gated norm, whose eps is fixed at "
            f"{MIXER_NORM_EPS} in Megatron's MambaMixer (NPUMambaMixer)",
        )
    if getattr(h, "tie_word_embeddings", False):
        _refuse(
            "tie_word_embeddings",
            True,
            "transformers 5.25's NemotronHForCausalLM keeps lm_head apart from the embeddings "
            "(_tied_weights_keys is empty); use a checkpoint with it false",
        )


def config_keywords(hf_config) -> dict:
    """The ``TransformerConfig`` keywords of a Nemotron-H Hugging Face config."""
    check_supported(hf_config)
    h = hf_config
    return dict(
        num_layers=len(hybrid_pattern(h)),
        is_hybrid_model=True,
        normalization="RMSNorm",
        layernorm_epsilon=h.layer_norm_epsilon,
        add_bias_linear=False,
        activation_func=squared_relu,
        gated_linear_unit=False,
        kv_channels=getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads,
        num_query_groups=h.num_key_value_heads,
        ffn_hidden_size=h.intermediate_size,
        mamba_state_dim=h.ssm_state_size,
        mamba_head_dim=h.mamba_head_dim,
        mamba_num_groups=h.n_groups,
        mamba_num_heads=h.mamba_num_heads,
        hidden_dropout=getattr(h, "hidden_dropout", 0.0),
        attention_dropout=getattr(h, "attention_dropout", 0.0),
    )


def mixer_params(hf_config) -> dict:
    """The Mamba mixer's own keywords (the spec's ``params``): conv width, chunk, conv bias."""
    return dict(
        d_conv=hf_config.conv_kernel,
        chunk_size=hf_config.chunk_size,
        conv_bias=bool(hf_config.use_conv_bias),
    )


def hybrid_stack_spec(hf_config, *, kernel: str = "auto", **spec_keywords):
    """``get_hybrid_stack_npu_spec(kernel=..., **spec_keywords)`` (``spec_keywords``: the NPU
    spec's fused-operator kernels, as a recipe sets them) with the mixer's params from the config
    (the spec's mamba layer and mixer copied, the rest as built)."""
    from mcore_npu.transformer.mamba.spec import get_hybrid_stack_npu_spec

    spec = copy.copy(get_hybrid_stack_npu_spec(kernel=kernel, **spec_keywords))
    spec.submodules = copy.copy(spec.submodules)
    layer = copy.copy(spec.submodules.mamba_layer)
    layer.submodules = copy.copy(layer.submodules)
    mixer = copy.copy(layer.submodules.mixer)
    mixer.params = {**(mixer.params or {}), **mixer_params(hf_config)}
    layer.submodules.mixer = mixer
    spec.submodules.mamba_layer = layer
    return spec


def in_proj_sections(hf_config) -> tuple[int, ...]:
    """Row counts of ``in_proj``: ``z, x, B, C, dt`` (whole model)."""
    d_inner = hf_config.mamba_num_heads * hf_config.mamba_head_dim
    bc = hf_config.n_groups * hf_config.ssm_state_size
    return (d_inner, d_inner, bc, bc, hf_config.mamba_num_heads)


def split_sections(weight: torch.Tensor, sections, tp: int) -> list[torch.Tensor]:
    """Each section split in ``tp`` row chunks; rank r's tensor is its chunks concatenated."""
    chunks = [part.chunk(tp) for part in torch.split(weight, list(sections))]
    return [torch.cat([c[r] for c in chunks]).contiguous() for r in range(tp)]


def merge_sections(weights: list[torch.Tensor], sections) -> torch.Tensor:
    """The inverse of :func:`split_sections`: the ranks' tensors -> the whole tensor."""
    local = [s // len(weights) for s in sections]
    per_rank = [torch.split(w, local) for w in weights]
    return torch.cat([torch.cat([parts[i] for parts in per_rank]) for i in range(len(local))])


@register_model(list(MODEL_TYPES))
class NemotronHBridge(LLMBridge):
    """mbridge bridge for ``nemotron_h``: Megatron's hybrid model from the NPU spec."""

    _CONFIG_MAPPING = {**LLMBridge._CONFIG_MAPPING, "layernorm_epsilon": "layer_norm_epsilon"}
    own_npu_spec = True  # hf.use_npu_spec sets npu_kernel instead of a GPT layer spec
    npu_spec_keywords: dict = {}  # the NPU engine's recipe spec keywords (replaced, never mutated)

    def __init__(self, hf_config, *args, **kwargs):
        self.pattern = hybrid_pattern(hf_config)
        self.npu_kernel = "auto"
        self.prefix, self.embedding_name = PREFIXES[0], "embeddings.weight"
        super().__init__(hf_config, *args, **kwargs)
        mtp = int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)
        if mtp:
            message = (
                "num_nextn_predict_layers: %d; the MTP layers (mtp.*) are not built, as "
                "transformers' NemotronHForCausalLM does not build them"
            )
            logger.warning(message, mtp)

    def _build_config(self):
        return self._build_base_config(**config_keywords(self.hf_config))

    def _get_transformer_layer_spec(self, vp_stage=None):
        keywords = {"kernel": self.npu_kernel, **self.npu_spec_keywords}
        return hybrid_stack_spec(self.hf_config, **keywords)

    def _model_provider(self, post_model_creation_callbacks):
        from mcore_npu.transformer.mamba.stack import hybrid_model_class

        model_class, spec_key, pattern_key = hybrid_model_class()
        accepts_vp_stage = "vp_stage" in inspect.signature(model_class.__init__).parameters

        def build(pre_process, post_process, vp_stage):
            self.vocab_size = self.padded_vocab_size = self.hf_config.vocab_size
            if self.make_vocab_size_divisible_by is not None:
                step = self.make_vocab_size_divisible_by
                self.padded_vocab_size = math.ceil(self.vocab_size / step) * step
            extra = {"vp_stage": vp_stage} if vp_stage is not None and accepts_vp_stage else {}
            return model_class(
                config=self.config,
                vocab_size=self.padded_vocab_size,
                max_sequence_length=self.hf_config.max_position_embeddings,
                pre_process=pre_process,
                post_process=post_process,
                share_embeddings_and_output_weights=False,
                position_embedding_type="none",
                **{spec_key: self._get_transformer_layer_spec(vp_stage)},
                **{pattern_key: self.pattern},
                **extra,
            )

        return model_provider(self, build, post_model_creation_callbacks)

    def _get_safetensor_io(self, weights_path: str):
        io = super()._get_safetensor_io(weights_path)
        names = set(io.load_hf_weight_names())
        for prefix in PREFIXES:  # the checkpoint's own prefix wins
            if any(name.startswith(f"{prefix}layers.") for name in names):
                self.prefix = prefix
                break
        if f"{self.prefix}embedding.weight" in names:  # checkpoints before transformers 5
            self.embedding_name = "embedding.weight"
        return io

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        """Hugging Face names of one Megatron (global) name (``ValueError`` if none)."""
        top = {
            "embedding.word_embeddings.weight": f"{self.prefix}{self.embedding_name}",
            "decoder.final_norm.weight": f"{self.prefix}norm_f.weight",
            "output_layer.weight": "lm_head.weight",
        }
        if mcore_weights_name in top:
            return [top[mcore_weights_name]]
        match = _LAYER.match(mcore_weights_name)
        names = None if match is None else _LAYER_MAP.get(match.group(2))
        if names is None:
            raise ValueError(
                f"{mcore_weights_name}: no Hugging Face tensor of nemotron_h maps to this "
                "Megatron parameter; build the model through this bridge (get_hybrid_stack_npu_spec)"
            )
        layer = f"{self.prefix}layers.{match.group(1)}."
        return [layer + name for name in names]

    def _weight_to_mcore_format(self, mcore_weights_name: str, hf_weights: list[torch.Tensor]):
        """Hugging Face tensors -> the Megatron tensor; ``A_log`` and ``D`` (fp32 parameters)
        keep the checkpoint's precision."""
        if mcore_weights_name.endswith(("mixer.A_log", "mixer.D")):
            return hf_weights[0]
        return super()._weight_to_mcore_format(mcore_weights_name, hf_weights)

    def _weight_to_hf_format(self, mcore_weights_name: str, mcore_weights: torch.Tensor):
        """The Megatron tensor -> Hugging Face tensors; ``A_log`` / ``D`` in the bridge's dtype."""
        names, weights = super()._weight_to_hf_format(mcore_weights_name, mcore_weights)
        if mcore_weights_name.endswith(("mixer.A_log", "mixer.D")) and self.dtype is not None:
            weights = [w.to(self.dtype) for w in weights]
        return names, weights

    def _sections(self, mcore_weights_name: str) -> tuple[int, ...] | None:
        """Row sections each TP rank holds a slice of (``in_proj``: z x B C dt; ``conv1d``:
        x B C), or None."""
        match = _SECTIONED.search(mcore_weights_name)
        if match is None:
            return None
        sections = in_proj_sections(self.hf_config)
        return sections if match.group(1) == "in_proj.weight" else sections[1:4]

    def _weight_split_across_tp(self, mcore_weights_name, mcore_weights, param, tp_split_size):
        sections = self._sections(mcore_weights_name)
        if sections is None or tp_split_size == 1:
            return super()._weight_split_across_tp(
                mcore_weights_name, mcore_weights, param, tp_split_size
            )
        return split_sections(mcore_weights, sections, tp_split_size)

    def _weight_merge_across_tp(self, mcore_weights_name, mcore_weights, param):
        sections = self._sections(mcore_weights_name)
        if sections is None or self.mpu.tp_size == 1:
            return super()._weight_merge_across_tp(mcore_weights_name, mcore_weights, param)
        return merge_sections(list(mcore_weights), sections)


# Megatron name after ``decoder.layers.{i}.`` -> Hugging Face names after ``{P}layers.{i}.``
_LAYER_MAP = {
    "mixer.in_proj.layer_norm_weight": ["norm.weight"],
    "mixer.in_proj.weight": ["mixer.in_proj.weight"],
    "mixer.conv1d.weight": ["mixer.conv1d.weight"],
    "mixer.conv1d.bias": ["mixer.conv1d.bias"],
    "mixer.A_log": ["mixer.A_log"],
    "mixer.D": ["mixer.D"],
    "mixer.dt_bias": ["mixer.dt_bias"],
    "mixer.norm.weight": ["mixer.norm.weight"],
    "mixer.out_proj.weight": ["mixer.out_proj.weight"],
    "self_attention.linear_qkv.layer_norm_weight": ["norm.weight"],
    "self_attention.linear_qkv.weight": [f"mixer.{p}_proj.weight" for p in "qkv"],
    "self_attention.linear_proj.weight": ["mixer.o_proj.weight"],
    "mlp.linear_fc1.layer_norm_weight": ["norm.weight"],
    "mlp.linear_fc1.weight": ["mixer.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mixer.down_proj.weight"],
}
