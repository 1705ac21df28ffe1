"""Qwen3-VL's Hugging Face configs for the plugin's model (``mcore_npu.transformer.vision``): the
two ``TransformerConfig``s and the builder of one pipeline stage. The weights: the one name and
tensor map of :mod:`.hf_qwen3_vl_weights` (used by the one-process load / export re-exported
here and by the mbridge bridge, :mod:`.hf_qwen3_vl_bridge`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from mcore_npu.transformer.vision import NPUVisionTower, VisionShape

_ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def vision_config(hf_vision, *, dtype=torch.float32, **overrides) -> TransformerConfig:
    """The blocks' ``TransformerConfig`` of a transformers ``Qwen3VLVisionConfig``."""
    act = getattr(hf_vision, "hidden_act", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"vision_config.hidden_act: {act!r}; the vision tower builds "
            f"{', '.join(_ACTIVATIONS)}; use a Qwen3-VL checkpoint's vision config"
        )
    keywords = dict(
        num_layers=hf_vision.depth,
        hidden_size=hf_vision.hidden_size,
        num_attention_heads=hf_vision.num_heads,
        ffn_hidden_size=hf_vision.intermediate_size,
        kv_channels=hf_vision.hidden_size // hf_vision.num_heads,
        normalization="LayerNorm",
        layernorm_epsilon=1e-6,
        add_bias_linear=True,
        add_qkv_bias=True,
        gated_linear_unit=False,
        activation_func=_ACTIVATIONS[act],
        bias_activation_fusion=False,
    )
    return _config(keywords, dtype, overrides)


def _config(keywords: dict, dtype, overrides: dict) -> TransformerConfig:
    """``TransformerConfig(**keywords)`` without dropout, in ``dtype``, built on the host, then
    ``overrides``."""
    keywords = dict(keywords, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
                    bf16=dtype == torch.bfloat16, use_cpu_initialization=True)  # fmt: skip
    keywords.update(overrides)
    return TransformerConfig(**keywords)


def vision_shape(hf_vision) -> VisionShape:
    """The tower's :class:`VisionShape` of a transformers ``Qwen3VLVisionConfig``."""
    return VisionShape(
        in_channels=hf_vision.in_channels,
        patch_size=hf_vision.patch_size,
        temporal_patch_size=hf_vision.temporal_patch_size,
        spatial_merge_size=hf_vision.spatial_merge_size,
        num_position_embeddings=hf_vision.num_position_embeddings,
        out_hidden_size=hf_vision.out_hidden_size,
        deepstack_visual_indexes=tuple(getattr(hf_vision, "deepstack_visual_indexes", None) or ()),
    )


def language_keywords(hf_config) -> dict:
    """The language model's ``TransformerConfig`` keywords beyond mbridge's shared mapping
    (layers, sizes, heads, eps: :func:`language_config` adds those)."""
    text = hf_config.text_config
    if getattr(text, "attention_bias", False):
        raise ValueError(
            "text_config.attention_bias: True; Qwen3-VL's text stack has no q/k/v "
            "bias: use a Qwen3-VL checkpoint's config"
        )
    rope = dict(getattr(text, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise ValueError(
            f"text_config.rope_parameters.rope_type: {kind!r}; the Qwen3-VL model builds the "
            "default interleaved mRoPE; use a checkpoint with rope_type 'default'"
        )
    return dict(
        kv_channels=text.head_dim,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        mrope_section=list(rope.get("mrope_section", (24, 20, 20))),
        **(_moe_keywords(text) if getattr(text, "num_experts", 0) else {}),
    )


def _moe_keywords(text) -> dict:
    """Qwen3-VL-MoE's experts: softmax router, top-k renormalised (``moe_router_pre_softmax``
    False), grouped experts (TE names ``linear_fc1.weight{e}``), MoE layers from
    ``mlp_only_layers`` / ``decoder_sparse_step``; no auxiliary loss unless a recipe sets one."""
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(text.num_hidden_layers)]
    return dict(
        num_moe_experts=text.num_experts,
        moe_router_topk=text.num_experts_per_tok,
        moe_ffn_hidden_size=text.moe_intermediate_size,
        moe_layer_freq=pattern if 0 in pattern else 1,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=True,
    )


def language_config(hf_config, *, dtype=torch.float32, **overrides) -> TransformerConfig:
    """The language model's ``TransformerConfig`` of a ``Qwen3VLConfig`` (one process)."""
    text = hf_config.text_config
    keywords = dict(
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads,
        num_query_groups=text.num_key_value_heads,
        ffn_hidden_size=text.intermediate_size,
        layernorm_epsilon=text.rms_norm_eps,
        **language_keywords(hf_config),
    )
    return _config(keywords, dtype, overrides)


def build_qwen3_vl(hf_config, *, dtype=torch.float32, kernel="auto", **overrides):
    """An :class:`~mcore_npu.transformer.vision.model.NPUQwen3VLModel` for ``hf_config`` in one
    process (weights not loaded); ``overrides``: the language config's."""
    config = language_config(hf_config, dtype=dtype, **overrides)
    vision = vision_config(hf_config.vision_config, dtype=dtype)
    return qwen3_vl_model(hf_config, config, vision, kernel=kernel)


def qwen3_vl_model(
    hf_config,
    config,
    vision_cfg,
    *,
    kernel="auto",
    pre_process=True,
    post_process=True,
    vp_stage=None,
    spec_keywords=None,
):
    """Qwen3-VL's model of one pipeline stage from its two configs: the vision tower where
    ``pre_process``, the language model from the NPU decoder-block spec (TE names)."""
    spec = language_spec(config, kernel=kernel, vp_stage=vp_stage, **(spec_keywords or {}))
    return vision_language_model(
        hf_config, config, vision_cfg, spec,
        kernel=kernel, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
        **rope_args(hf_config),
    )  # fmt: skip


def rope_args(hf_config) -> dict:
    """Qwen3-VL's ``rotary_base`` and ``rotary_percent`` (the whole head rotates)."""
    rope = dict(getattr(hf_config.text_config, "rope_parameters", None) or {})
    return {"rotary_base": rope.get("rope_theta", 5_000_000), "rotary_percent": 1.0}


def language_spec(config, *, kernel="auto", vp_stage=None, **spec_keywords):
    """The language model's NPU decoder-block spec (TE names, RMSNorm; a GDN config's hybrid)."""
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    return get_gpt_decoder_block_npu_spec(
        config, kernel=kernel, param_layout="te", normalization="RMSNorm", vp_stage=vp_stage,
        **spec_keywords,
    )  # fmt: skip


def vision_language_model(
    hf_config,
    config,
    vision_cfg,
    spec,
    *,
    rotary_base,
    rotary_percent,
    kernel="auto",
    pre_process=True,
    post_process=True,
    vp_stage=None,
):
    """An :class:`~mcore_npu.transformer.vision.model.NPUQwen3VLModel` stage of a Qwen3-VL or a
    Qwen3.5 hub config: ``spec``'s language model with interleaved mRoPE (``rotary_base``,
    ``rotary_percent``), the vision tower where ``pre_process``."""
    from mcore_npu.transformer.vision.model import DeepstackGPTModel, NPUQwen3VLModel

    text = hf_config.text_config
    extra = {} if vp_stage is None else {"vp_stage": vp_stage}
    language = DeepstackGPTModel(
        config,
        spec,
        text.vocab_size,
        text.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rotary_base=rotary_base,
        rotary_percent=rotary_percent,
        **extra,
    )
    tower = None
    if pre_process:
        tower = NPUVisionTower(vision_cfg, vision_shape(hf_config.vision_config), kernel=kernel)
    return NPUQwen3VLModel(
        language,
        tower,
        image_token_id=hf_config.image_token_id,
        video_token_id=hf_config.video_token_id,
        spatial_merge_size=hf_config.vision_config.spatial_merge_size,
    )
