"""Qwen3-VL's Hugging Face weights into the plugin's vision tower (``mcore_npu.transformer.vision``).

The vision tower keeps transformers' names for ``patch_embed``, ``pos_embed``, ``merger`` and
``deepstack_merger_list``; a block's names are the TE spec's::

    blocks.{i}.norm1.{weight,bias}      blocks.{i}.self_attention.linear_qkv.layer_norm_{weight,bias}
    blocks.{i}.attn.qkv.{weight,bias}   blocks.{i}.self_attention.linear_qkv.{weight,bias}
    blocks.{i}.attn.proj.*              blocks.{i}.self_attention.linear_proj.*
    blocks.{i}.norm2.{weight,bias}      blocks.{i}.mlp.linear_fc1.layer_norm_{weight,bias}
    blocks.{i}.mlp.linear_fc{1,2}.*     blocks.{i}.mlp.linear_fc{1,2}.*

transformers' ``qkv`` rows are ``[3, heads, head_dim]`` (all q, all k, all v); Megatron's are per
head ``[heads, 3, head_dim]``. Every tensor is moved, never changed, so export is bit-exact.
docs/vision.md has the whole map."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from mcore_npu.transformer.vision import NPUVisionTower, VisionShape

_BLOCK = {
    "norm1.weight": "self_attention.linear_qkv.layer_norm_weight",
    "norm1.bias": "self_attention.linear_qkv.layer_norm_bias",
    "attn.qkv.weight": "self_attention.linear_qkv.weight",
    "attn.qkv.bias": "self_attention.linear_qkv.bias",
    "attn.proj.weight": "self_attention.linear_proj.weight",
    "attn.proj.bias": "self_attention.linear_proj.bias",
    "norm2.weight": "mlp.linear_fc1.layer_norm_weight",
    "norm2.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias": "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias": "mlp.linear_fc2.bias",
}
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
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
    )
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
        deepstack_visual_indexes=tuple(hf_vision.deepstack_visual_indexes or ()),
    )


def build_vision_tower(hf_vision, *, dtype=torch.float32, kernel="auto", **overrides):
    """An :class:`NPUVisionTower` for ``hf_vision`` (weights not loaded)."""
    config = vision_config(hf_vision, dtype=dtype, **overrides)
    return NPUVisionTower(config, vision_shape(hf_vision), kernel=kernel)


def vision_name(hf_name: str) -> str:
    """The tower's name of a transformers vision parameter (without ``model.visual.``)."""
    if hf_name.startswith("blocks."):
        _, index, rest = hf_name.split(".", 2)
        if rest not in _BLOCK:
            raise KeyError(f"{hf_name}: not a Qwen3-VL vision block parameter")
        return f"blocks.{index}.{_BLOCK[rest]}"
    return hf_name


def _heads_first(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[3·n·d, ...]`` rows (q | k | v) -> ``[n·3·d, ...]`` (per head q, k, v)."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _qkv_first(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def load_vision_weights(tower: NPUVisionTower, hf_state: dict) -> None:
    """Copy transformers' vision tensors (names without ``model.visual.``) into ``tower``;
    KeyError naming what is missing or left over."""
    heads = tower.config.num_attention_heads
    params = dict(tower.named_parameters())
    seen = set()
    for hf_name, tensor in hf_state.items():
        name = vision_name(hf_name)
        if name not in params:
            raise KeyError(f"{hf_name}: no parameter {name} in the vision tower")
        if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            tensor = _heads_first(tensor, heads)
        with torch.no_grad():
            params[name].copy_(tensor)
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise KeyError(f"vision tower parameters not in the checkpoint: {missing[:4]}")


def export_vision_weights(tower: NPUVisionTower) -> dict[str, torch.Tensor]:
    """transformers' vision tensors (names without ``model.visual.``) of ``tower``."""
    heads = tower.config.num_attention_heads
    inverse = {v: k for k, v in _BLOCK.items()}
    out = {}
    for name, param in tower.named_parameters():
        tensor = param.detach()
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            if rest.startswith("self_attention.linear_qkv.") and "layer_norm" not in rest:
                tensor = _qkv_first(tensor, heads)
            name = f"blocks.{index}.{inverse[rest]}"
        out[name] = tensor.clone()
    return out


# The language model (Qwen3 / Qwen3-MoE text stack) after ``model.language_model.layers.{i}.``
_TEXT_LAYER = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
TEXT_PREFIX, VISION_PREFIX = "model.language_model.", "model.visual."


def language_config(hf_config, *, dtype=torch.float32, **overrides) -> TransformerConfig:
    """The language model's ``TransformerConfig`` of a ``Qwen3VLConfig`` (dense text stack)."""
    text = hf_config.text_config
    rope = dict(getattr(text, "rope_parameters", None) or {})
    if getattr(text, "attention_bias", False):
        raise ValueError(
            "text_config.attention_bias: True; Qwen3-VL's text stack has no q/k/v "
            "bias: use a Qwen3-VL checkpoint's config"
        )
    keywords = dict(
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads,
        num_query_groups=text.num_key_value_heads,
        kv_channels=text.head_dim,
        ffn_hidden_size=text.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=text.rms_norm_eps,
        qk_layernorm=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mrope_section=list(rope.get("mrope_section", (24, 20, 20))),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
    )
    keywords.update(overrides)
    return TransformerConfig(**keywords)


def build_qwen3_vl(
    hf_config,
    *,
    dtype=torch.float32,
    kernel="auto",
    pre_process=True,
    post_process=True,
    **overrides,
):
    """An :class:`~mcore_npu.transformer.vision.model.NPUQwen3VLModel` for ``hf_config``
    (weights not loaded): the vision tower on the first stage, the language model in TE names."""
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec
    from mcore_npu.transformer.vision.model import DeepstackGPTModel, NPUQwen3VLModel

    text = hf_config.text_config
    config = language_config(hf_config, dtype=dtype, **overrides)
    spec = get_gpt_decoder_block_npu_spec(
        config, kernel=kernel, param_layout="te", normalization="RMSNorm"
    )
    rope = dict(getattr(text, "rope_parameters", None) or {})
    language = DeepstackGPTModel(
        config,
        spec,
        text.vocab_size,
        text.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        rotary_base=rope.get("rope_theta", 5_000_000),
        rotary_percent=1.0,
    )
    vision = (
        build_vision_tower(
            hf_config.vision_config,
            dtype=dtype,
            kernel=kernel,
            tensor_model_parallel_size=config.tensor_model_parallel_size,
        )
        if pre_process
        else None
    )
    return NPUQwen3VLModel(
        language,
        vision,
        image_token_id=hf_config.image_token_id,
        video_token_id=hf_config.video_token_id,
        spatial_merge_size=hf_config.vision_config.spatial_merge_size,
    )


def _grouped_qkv(q, k, v, groups: int) -> torch.Tensor:
    """``q [n·d, H]``, ``k``/``v`` ``[g·d, H]`` -> Megatron's per group ``[q heads | k | v]``."""
    hidden = q.shape[-1]
    parts = (
        q.reshape(groups, -1, hidden),
        k.reshape(groups, -1, hidden),
        v.reshape(groups, -1, hidden),
    )
    return torch.cat(parts, dim=1).reshape(-1, hidden)


def _split_qkv(qkv, groups: int, heads: int, dim: int):
    hidden = qkv.shape[-1]
    per = heads // groups
    q, k, v = torch.split(qkv.reshape(groups, -1, hidden), [per * dim, dim, dim], dim=1)
    return tuple(t.reshape(-1, hidden).contiguous() for t in (q, k, v))


def load_qwen3_vl_weights(model, hf_state: dict) -> None:
    """Copy a transformers Qwen3-VL state dict (``model.visual.*``, ``model.language_model.*``,
    ``lm_head.weight``) into ``model`` (one process, TP = 1); KeyError for what is left over."""
    vision = {
        k[len(VISION_PREFIX) :]: v for k, v in hf_state.items() if k.startswith(VISION_PREFIX)
    }
    if model.vision is not None:
        load_vision_weights(model.vision, vision)
    params = dict(model.language_model.named_parameters())
    for name, tensor in _language_tensors(model.language_model.config, hf_state).items():
        if name not in params:
            raise KeyError(f"{name}: not a parameter of the language model")
        with torch.no_grad():
            params[name].copy_(tensor)
        params.pop(name)
    if params:
        raise KeyError(f"language model parameters not in the checkpoint: {sorted(params)[:4]}")


def _language_tensors(config, hf_state: dict) -> dict[str, torch.Tensor]:
    """Megatron name -> tensor for the text stack of ``hf_state``."""
    out = {
        "embedding.word_embeddings.weight": hf_state[f"{TEXT_PREFIX}embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf_state[f"{TEXT_PREFIX}norm.weight"],
    }
    if "lm_head.weight" in hf_state:
        out["output_layer.weight"] = hf_state["lm_head.weight"]
    for i in range(config.num_layers):
        layer, mcore = f"{TEXT_PREFIX}layers.{i}.", f"decoder.layers.{i}."
        for hf, name in _TEXT_LAYER.items():
            out[mcore + name] = hf_state[layer + hf]
        q, k, v = (hf_state[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv")
        out[mcore + "self_attention.linear_qkv.weight"] = _grouped_qkv(
            q, k, v, config.num_query_groups
        )
        gate, up = (hf_state[f"{layer}mlp.{p}_proj.weight"] for p in ("gate", "up"))
        out[mcore + "mlp.linear_fc1.weight"] = torch.cat((gate, up))
    return out


def export_qwen3_vl_weights(model) -> dict[str, torch.Tensor]:
    """transformers' state dict of ``model`` (the inverse of :func:`load_qwen3_vl_weights`)."""
    out = {VISION_PREFIX + k: v for k, v in export_vision_weights(model.vision).items()}
    config = model.language_model.config
    params = {k: p.detach() for k, p in model.language_model.named_parameters()}
    out[f"{TEXT_PREFIX}embed_tokens.weight"] = params.pop("embedding.word_embeddings.weight")
    out[f"{TEXT_PREFIX}norm.weight"] = params.pop("decoder.final_layernorm.weight")
    if "output_layer.weight" in params:
        out["lm_head.weight"] = params.pop("output_layer.weight")
    for i in range(config.num_layers):
        layer, mcore = f"{TEXT_PREFIX}layers.{i}.", f"decoder.layers.{i}."
        for hf, name in _TEXT_LAYER.items():
            out[layer + hf] = params.pop(mcore + name)
        qkv = params.pop(mcore + "self_attention.linear_qkv.weight")
        parts = _split_qkv(
            qkv, config.num_query_groups, config.num_attention_heads, config.kv_channels
        )
        for p, t in zip("qkv", parts):
            out[f"{layer}self_attn.{p}_proj.weight"] = t
        gate, up = params.pop(mcore + "mlp.linear_fc1.weight").chunk(2)
        out[f"{layer}mlp.gate_proj.weight"], out[f"{layer}mlp.up_proj.weight"] = gate, up
    if params:
        raise KeyError(f"language model parameters with no transformers name: {sorted(params)}")
    return {k: v.clone() for k, v in out.items()}
