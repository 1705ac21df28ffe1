"""Qwen3-VL's one weight map: the plugin model's parameter names and tensors <-> transformers'.

The vision tower (``vision.``) keeps transformers' names for ``patch_embed``, ``pos_embed``,
``merger`` and ``deepstack_merger_list``; a block's are the TE spec's (:data:`_VISION_BLOCK`).
transformers' ``qkv`` rows are ``[3, heads, head_dim]`` (all q, all k, all v), Megatron's per head
``[heads, 3, head_dim]``. The language model (``language_model.``) maps as a Qwen3's: q/k/v into
``linear_qkv`` per query group, gate/up into ``linear_fc1``; Qwen3-VL-MoE's fused experts by row
(``"gate_up_proj[e]"``), in transformers 5's layout (``[E, 2I, H]``) or the hub's
(``[E, H, 2I]``). Every tensor is moved, never changed, so export is bit-exact. The map is used
by :func:`load_qwen3_vl_weights` / :func:`export_qwen3_vl_weights` (one process) and by the
bridge's loader and exporter (any TP / PP / EP). docs/vision.md shows it whole."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

TEXT_PREFIX, VISION_PREFIX = "model.language_model.", "model.visual."
# plugin name after ``vision.blocks.{i}.`` -> transformers' after ``model.visual.blocks.{i}.``
_VISION_BLOCK = {
    "self_attention.linear_qkv.layer_norm_weight": "norm1.weight",
    "self_attention.linear_qkv.layer_norm_bias": "norm1.bias",
    "self_attention.linear_qkv.weight": "attn.qkv.weight",
    "self_attention.linear_qkv.bias": "attn.qkv.bias",
    "self_attention.linear_proj.weight": "attn.proj.weight",
    "self_attention.linear_proj.bias": "attn.proj.bias",
    "mlp.linear_fc1.layer_norm_weight": "norm2.weight",
    "mlp.linear_fc1.layer_norm_bias": "norm2.bias",
    "mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias": "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias": "mlp.linear_fc2.bias",
}
# plugin name after ``language_model.decoder.layers.{i}.`` -> transformers' after
# ``model.language_model.layers.{i}.`` (q/k/v, gate/up and the experts: hf_names)
_TEXT_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # dense layers
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",  # MoE layers
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_TEXT_TOP = {
    "embedding.word_embeddings.weight": f"{TEXT_PREFIX}embed_tokens.weight",
    "decoder.final_layernorm.weight": f"{TEXT_PREFIX}norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_EXPERT = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")
_ROW = re.compile(r"^(.+)\[(\d+)\]$")  # row e of a fused expert tensor: "name[e]"


@dataclass(frozen=True)
class Shapes:
    """What the re-ordering needs: vision heads; language heads, kv groups, head dim; hidden and
    expert FFN sizes (which way round an expert's tensor is)."""

    vision_heads: int
    heads: int
    groups: int
    head_dim: int
    hidden: int = 0
    expert_ffn: int = 0

    @classmethod
    def of(cls, hf_config) -> Shapes:
        """Of a transformers ``Qwen3VL(Moe)Config``."""
        text = hf_config.text_config
        return cls(hf_config.vision_config.num_heads, text.num_attention_heads,
                   text.num_key_value_heads, text.head_dim, text.hidden_size,
                   int(getattr(text, "moe_intermediate_size", 0) or 0))  # fmt: skip

    @classmethod
    def of_model(cls, model) -> Shapes:
        """Of a built ``NPUQwen3VLModel``."""
        config = model.language_model.config
        vision = model.vision.config.num_attention_heads if model.vision is not None else 0
        return cls(vision, config.num_attention_heads, config.num_query_groups,
                   config.kv_channels, config.hidden_size,
                   int(config.moe_ffn_hidden_size or 0))  # fmt: skip


def hf_names(name: str) -> list[str]:
    """transformers' names of the plugin model's parameter ``name`` (``vision.*`` /
    ``language_model.*``, global layer numbers); KeyError for one it has no name for."""
    if name.startswith("vision."):
        return [VISION_PREFIX + _vision_name(name[len("vision.") :])]
    rest = name.removeprefix("language_model.")
    if rest in _TEXT_TOP:
        return [_TEXT_TOP[rest]]
    parts = rest.split(".", 3)
    if rest != name and parts[:2] == ["decoder", "layers"] and len(parts) == 4:
        layer, tail = f"{TEXT_PREFIX}layers.{parts[2]}.", parts[3]
        names = _layer_names(tail)
        if names:
            return [layer + n for n in names]
    raise KeyError(f"{name}: no transformers tensor of Qwen3-VL maps to this parameter")


def _layer_names(tail: str) -> list[str]:
    if tail == "self_attention.linear_qkv.weight":
        return [f"self_attn.{p}_proj.weight" for p in "qkv"]
    if tail == "mlp.linear_fc1.weight":
        return ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
    expert = _EXPERT.match(tail)
    if expert:  # row e of the fused tensor
        fused = "gate_up_proj" if expert.group(1) == "1" else "down_proj"
        return [f"mlp.experts.{fused}[{expert.group(2)}]"]
    return [_TEXT_LAYER[tail]] if tail in _TEXT_LAYER else []


def _vision_name(name: str) -> str:
    if not name.startswith("blocks."):
        return name  # patch_embed, pos_embed, merger, deepstack_merger_list: transformers' own
    _, index, rest = name.split(".", 2)
    if rest not in _VISION_BLOCK:
        raise KeyError(f"vision.{name}: not a parameter of a vision block")
    return f"blocks.{index}.{_VISION_BLOCK[rest]}"


def fused_row(hf_name: str) -> tuple[str, int] | None:
    """``("…gate_up_proj", e)`` for a fused expert's row name ``"…gate_up_proj[e]"``, else None."""
    row = _ROW.match(hf_name)
    return None if row is None else (row.group(1), int(row.group(2)))


def expert_shape(name: str, shapes: Shapes) -> tuple[int, int] | None:
    """Megatron's shape of an expert's ``linear_fc1`` / ``linear_fc2`` (None: not an expert)."""
    match = _EXPERT.match("mlp." + name.rsplit(".mlp.", 1)[-1])
    if match is None:
        return None
    ffn, hidden = shapes.expert_ffn, shapes.hidden
    return (2 * ffn, hidden) if match.group(1) == "1" else (hidden, ffn)


def _is_vision_qkv(name: str) -> bool:
    return name.startswith("vision.") and ".linear_qkv." in name and "layer_norm" not in name


def to_mcore(name: str, tensors: list[torch.Tensor], shapes: Shapes) -> torch.Tensor:
    """The whole (unsplit) parameter ``name`` from transformers' tensors (:func:`hf_names`)."""
    expert = expert_shape(name, shapes)
    if expert is not None:  # transformers 5's row is Megatron's; the hub's is its transpose
        t = tensors[0]
        return t if tuple(t.shape) == expert else t.T
    if _is_vision_qkv(name):  # rows [3, heads, d] -> [heads, 3, d]
        t = tensors[0]
        return t.reshape(3, shapes.vision_heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    if name.endswith("self_attention.linear_qkv.weight"):  # q, k, v -> per group [q.. | k | v]
        hidden = tensors[0].shape[-1]
        grouped = [t.reshape(shapes.groups, -1, hidden) for t in tensors]
        return torch.cat(grouped, dim=1).reshape(-1, hidden)
    if len(tensors) == 2:  # gate, up
        return torch.cat(tensors)
    return tensors[0]


def to_hf(name: str, tensor: torch.Tensor, shapes: Shapes) -> list[torch.Tensor]:
    """transformers' tensors of the whole parameter ``name`` (the inverse of :func:`to_mcore`;
    an expert's row in transformers 5's layout)."""
    if _is_vision_qkv(name):
        t = tensor
        return [
            t.reshape(shapes.vision_heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        ]
    if name.endswith("self_attention.linear_qkv.weight"):
        hidden, per = tensor.shape[-1], shapes.heads // shapes.groups
        split = [per * shapes.head_dim, shapes.head_dim, shapes.head_dim]
        parts = torch.split(tensor.reshape(shapes.groups, -1, hidden), split, dim=1)
        return [p.reshape(-1, hidden) for p in parts]
    if name.startswith("language_model.") and name.endswith("mlp.linear_fc1.weight"):
        return list(tensor.chunk(2))
    return [tensor]


def expert_layout(hf_state: dict, shapes: Shapes) -> str:
    """``"hub"`` when the fused ``gate_up_proj`` is ``[E, H, 2I]`` (H != 2I), else
    ``"transformers"`` (``[E, 2I, H]``; also without experts)."""
    for name, tensor in hf_state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            square = shapes.hidden == 2 * shapes.expert_ffn
            return "hub" if not square and tensor.shape[1] == shapes.hidden else "transformers"
    return "transformers"


def load_qwen3_vl_weights(model, hf_state: dict) -> None:
    """Copy a transformers Qwen3-VL(-MoE) state dict into ``model`` (one process, TP = PP = 1);
    KeyError naming a tensor the state dict lacks. The experts' layout is remembered on the
    model (``hf_expert_layout``) for export."""
    shapes = Shapes.of_model(model)
    model.hf_expert_layout = expert_layout(hf_state, shapes)
    for name, param in model.named_parameters():
        tensors = [_read(hf_state, hf_name, name) for hf_name in hf_names(name)]
        with torch.no_grad():
            param.copy_(to_mcore(name, tensors, shapes))


def _read(hf_state: dict, hf_name: str, name: str) -> torch.Tensor:
    row = fused_row(hf_name)
    key = row[0] if row else hf_name
    if key not in hf_state:
        raise KeyError(f"{name}: the state dict has no {key}")
    return hf_state[key][row[1]] if row else hf_state[key]


def export_qwen3_vl_weights(model) -> dict[str, torch.Tensor]:
    """transformers' state dict of ``model`` (the inverse of :func:`load_qwen3_vl_weights`),
    the experts fused again in the layout loaded."""
    shapes = Shapes.of_model(model)
    out, rows = {}, {}
    for name, param in model.named_parameters():
        for hf_name, tensor in zip(hf_names(name), to_hf(name, param.detach(), shapes)):
            row = fused_row(hf_name)
            if row:
                rows.setdefault(row[0], {})[row[1]] = tensor
            else:
                out[hf_name] = tensor.clone()
    hub = getattr(model, "hf_expert_layout", "transformers") == "hub"
    for fused, experts in rows.items():
        stacked = torch.stack([experts[e] for e in range(len(experts))])
        out[fused] = stacked.transpose(1, 2).contiguous() if hub else stacked.clone()
    return out
