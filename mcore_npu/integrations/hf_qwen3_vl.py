"""Qwen3-VL's Hugging Face configs and weights for the plugin's model
(``mcore_npu.transformer.vision``): the configs, the builder, and one name and tensor map used
by the one-process load / export here and by the mbridge bridge (:mod:`.hf_qwen3_vl_bridge`).

The vision tower (``vision.``) keeps transformers' names for ``patch_embed``, ``pos_embed``, ``merger`` and
``deepstack_merger_list``; a block's names are the TE spec's::

    blocks.{i}.norm1.{weight,bias}      blocks.{i}.self_attention.linear_qkv.layer_norm_{weight,bias}
    blocks.{i}.attn.qkv.{weight,bias}   blocks.{i}.self_attention.linear_qkv.{weight,bias}
    blocks.{i}.attn.proj.*              blocks.{i}.self_attention.linear_proj.*
    blocks.{i}.norm2.{weight,bias}      blocks.{i}.mlp.linear_fc1.layer_norm_{weight,bias}
    blocks.{i}.mlp.linear_fc{1,2}.*     blocks.{i}.mlp.linear_fc{1,2}.*

transformers' ``qkv`` rows are ``[3, heads, head_dim]`` (all q, all k, all v); Megatron's are per
head ``[heads, 3, head_dim]``. The language model (``language_model.``) maps as a Qwen3's. Every
tensor is moved, never changed, so export is bit-exact. docs/vision.md has the whole map."""

from __future__ import annotations

import re
from dataclasses import dataclass

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
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        **language_keywords(hf_config),
    )
    keywords.update(overrides)
    return TransformerConfig(**keywords)


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
    """The model of one pipeline stage from its two configs: the vision tower where
    ``pre_process``, the language model from the NPU decoder-block spec (TE names)."""
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec
    from mcore_npu.transformer.vision.model import DeepstackGPTModel, NPUQwen3VLModel

    if getattr(config, "context_parallel_size", 1) > 1:
        raise ValueError(
            f"context_parallel_size: {config.context_parallel_size}; the Qwen3-VL model does not "
            "split its packed tokens and image positions over context-parallel ranks yet; train "
            "it with context_parallel_size=1 (TP and PP are supported)"
        )
    text = hf_config.text_config
    spec = get_gpt_decoder_block_npu_spec(
        config,
        kernel=kernel,
        param_layout="te",
        normalization="RMSNorm",
        vp_stage=vp_stage,
        **(spec_keywords or {}),
    )
    rope = dict(getattr(text, "rope_parameters", None) or {})
    extra = {} if vp_stage is None else {"vp_stage": vp_stage}
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


TEXT_PREFIX, VISION_PREFIX = "model.language_model.", "model.visual."
# after ``model.language_model.layers.{i}.`` -> after ``language_model.decoder.layers.{i}.``
_TEXT_LAYER = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_MOE_LAYER = {"pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
              "mlp.router.weight": "mlp.gate.weight"}  # fmt: skip
_EXPERT = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")
_SLICE = re.compile(r"^(.+)\[(\d+)\]$")  # row e of a fused expert tensor: "name[e]"
_TEXT_TOP = {
    "embedding.word_embeddings.weight": "embed_tokens.weight",
    "decoder.final_layernorm.weight": "norm.weight",
}


@dataclass(frozen=True)
class Heads:
    """What the re-ordering needs: vision heads; language heads, kv groups, head dim; hidden
    size and expert FFN size (which way round an expert tensor is)."""

    vision: int
    heads: int
    groups: int
    dim: int
    hidden: int = 0
    expert_ffn: int = 0

    @classmethod
    def of(cls, hf_config) -> Heads:
        text = hf_config.text_config
        return cls(
            hf_config.vision_config.num_heads,
            text.num_attention_heads,
            text.num_key_value_heads,
            text.head_dim,
            text.hidden_size,
            int(getattr(text, "moe_intermediate_size", 0) or 0),
        )

    @classmethod
    def of_model(cls, model) -> Heads:
        config = model.language_model.config
        vision = model.vision.config.num_attention_heads if model.vision is not None else 0
        return cls(
            vision,
            config.num_attention_heads,
            config.num_query_groups,
            config.kv_channels,
            config.hidden_size,
            int(config.moe_ffn_hidden_size or 0),
        )


def hf_names(name: str) -> list[str]:
    """transformers' names of the plugin model's parameter ``name`` (``vision.*`` /
    ``language_model.*``, global layer numbers); KeyError for one it has no name for."""
    if name.startswith("vision."):
        return [VISION_PREFIX + _vision_hf_name(name[len("vision.") :])]
    rest = name.removeprefix("language_model.")
    if rest == "output_layer.weight":
        return ["lm_head.weight"]
    if rest in _TEXT_TOP:
        return [TEXT_PREFIX + _TEXT_TOP[rest]]
    parts = rest.split(".", 3)
    if parts[:2] == ["decoder", "layers"] and rest != name:
        layer, tail = f"{TEXT_PREFIX}layers.{parts[2]}.", parts[3]
        if tail == "self_attention.linear_qkv.weight":
            return [f"{layer}self_attn.{p}_proj.weight" for p in "qkv"]
        if tail == "mlp.linear_fc1.weight":
            return [f"{layer}mlp.gate_proj.weight", f"{layer}mlp.up_proj.weight"]
        expert = _EXPERT.match(tail)
        if expert:  # row e of the fused tensor
            fused = "gate_up_proj" if expert.group(1) == "1" else "down_proj"
            return [f"{layer}mlp.experts.{fused}[{expert.group(2)}]"]
        if tail in _MOE_LAYER:
            return [layer + _MOE_LAYER[tail]]
        inverse = {v: k for k, v in _TEXT_LAYER.items()}
        if tail in inverse:
            return [layer + inverse[tail]]
    raise KeyError(f"{name}: no transformers tensor of Qwen3-VL maps to this parameter")


def _vision_hf_name(name: str) -> str:
    if not name.startswith("blocks."):
        return name  # patch_embed, pos_embed, merger, deepstack_merger_list: transformers' own
    _, index, rest = name.split(".", 2)
    inverse = {v: k for k, v in _BLOCK.items()}
    if rest not in inverse:
        raise KeyError(f"vision.{name}: not a parameter of a vision block")
    return f"blocks.{index}.{inverse[rest]}"


def _is_vision_qkv(name: str) -> bool:
    return name.startswith("vision.") and ".linear_qkv." in name and "layer_norm" not in name


def to_mcore(name: str, tensors: list[torch.Tensor], heads: Heads) -> torch.Tensor:
    """The whole (unsplit) parameter ``name`` from transformers' tensors (:func:`hf_names`)."""
    expert = expert_shape(name, heads)
    if expert is not None:  # transformers 5's row is Megatron's; the hub's is its transpose
        t = tensors[0]
        return t if tuple(t.shape) == expert else t.T
    if _is_vision_qkv(name):  # rows [3, heads, d] -> [heads, 3, d]
        t = tensors[0]
        return t.reshape(3, heads.vision, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    if name.endswith("self_attention.linear_qkv.weight"):  # q, k, v -> per group [q.. | k | v]
        hidden = tensors[0].shape[-1]
        grouped = [t.reshape(heads.groups, -1, hidden) for t in tensors]
        return torch.cat(grouped, dim=1).reshape(-1, hidden)
    if len(tensors) == 2:  # gate, up
        return torch.cat(tensors)
    return tensors[0]


def fused_row(hf_name: str) -> tuple[str, int] | None:
    """``("…gate_up_proj", e)`` for a fused expert's row name ``"…gate_up_proj[e]"``, else None."""
    sliced = _SLICE.match(hf_name)
    return None if sliced is None else (sliced.group(1), int(sliced.group(2)))


def expert_shape(name: str, heads: Heads) -> tuple[int, int] | None:
    """Megatron's shape of an expert's ``linear_fc1`` / ``linear_fc2`` (None: not an expert)."""
    tail = name.rsplit(".mlp.", 1)[-1]
    match = _EXPERT.match("mlp." + tail)
    if match is None:
        return None
    ffn, hidden = heads.expert_ffn, heads.hidden
    return (2 * ffn, hidden) if match.group(1) == "1" else (hidden, ffn)


def to_hf(name: str, tensor: torch.Tensor, heads: Heads) -> list[torch.Tensor]:
    """transformers' tensors of the whole parameter ``name`` (the inverse of :func:`to_mcore`)."""
    if _is_vision_qkv(name):
        t = tensor
        return [t.reshape(heads.vision, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)]
    if name.endswith("self_attention.linear_qkv.weight"):
        hidden, per = tensor.shape[-1], heads.heads // heads.groups
        split = [per * heads.dim, heads.dim, heads.dim]
        parts = torch.split(tensor.reshape(heads.groups, -1, hidden), split, dim=1)
        return [p.reshape(-1, hidden) for p in parts]
    if name.startswith("language_model.") and name.endswith("mlp.linear_fc1.weight"):
        return list(tensor.chunk(2))
    return [tensor]


def load_qwen3_vl_weights(model, hf_state: dict) -> None:
    """Copy a transformers Qwen3-VL(-MoE) state dict into ``model`` (one process, TP = PP = 1);
    KeyError naming a tensor the model lacks or a parameter the state dict lacks. The experts'
    layout (transformers 5's ``[E, 2I, H]`` or the hub's ``[E, H, 2I]``) is remembered for
    export."""
    heads = Heads.of_model(model)
    model.hf_expert_layout = expert_layout(hf_state, heads)
    for name, param in model.named_parameters():
        names = hf_names(name)
        with torch.no_grad():
            param.copy_(to_mcore(name, [_read(hf_state, n, name) for n in names], heads))


def expert_layout(hf_state: dict, heads: Heads) -> str:
    """``"hub"`` when the fused ``gate_up_proj`` is ``[E, H, 2I]`` (H != 2I), else
    ``"transformers"`` (``[E, 2I, H]``, and no experts at all)."""
    for name, tensor in hf_state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            square = heads.hidden == 2 * heads.expert_ffn
            return "hub" if not square and tensor.shape[1] == heads.hidden else "transformers"
    return "transformers"


def _read(hf_state: dict, hf_name: str, name: str) -> torch.Tensor:
    sliced = _SLICE.match(hf_name)
    key = sliced.group(1) if sliced else hf_name
    if key not in hf_state:
        raise KeyError(f"{name}: the state dict has no {key}")
    return hf_state[key][int(sliced.group(2))] if sliced else hf_state[key]


def export_qwen3_vl_weights(model) -> dict[str, torch.Tensor]:
    """transformers' state dict of ``model`` (the inverse of :func:`load_qwen3_vl_weights`),
    the experts fused again in the layout loaded."""
    heads = Heads.of_model(model)
    out, rows = {}, {}
    for name, param in model.named_parameters():
        for hf_name, tensor in zip(hf_names(name), to_hf(name, param.detach(), heads)):
            sliced = _SLICE.match(hf_name)
            if sliced:
                rows.setdefault(sliced.group(1), {})[int(sliced.group(2))] = tensor
            else:
                out[hf_name] = tensor.clone()
    hub = getattr(model, "hf_expert_layout", "transformers") == "hub"
    for fused, experts in rows.items():
        stacked = torch.stack([experts[e] for e in range(len(experts))])
        out[fused] = stacked.transpose(1, 2).contiguous() if hub else stacked.clone()
    return out
