"""The plugin's mbridge bridge for the Gated DeltaNet hybrids: Qwen3.5 and Qwen3-Next.

mbridge 0.15.1 has none. :class:`Qwen3_5Bridge`, an ``LLMBridge`` registered with mbridge's
``register_model`` for :data:`MODEL_TYPES`, builds the hybrid's ``GDNTransformerConfig`` and maps
the Hugging Face weights onto the TE spec's names (``param_layout="te"``). Every tensor is moved,
never changed (the GDN ``out_norm`` gets ``w - 1`` only on a zero-centred module), so export is
bit-exact. Megatron's ``in_proj`` rows are ``[q | k | v | z | beta | alpha]`` and ``conv1d``'s
``[q | k | v]``, both per TP rank; the gated ``linear_qkv`` is per query group
``[q heads | gate heads | k | v]``. Experts load per expert or fused (``[E, 2I, H]`` /
``[E, H, I]``) and export in the form loaded. The hub form (``model.language_model.``, vision
tower included) is :mod:`.hf_qwen3_5_vl`'s. The weight map: docs/gdn_hf.md.
"""

from __future__ import annotations

import re

import torch
from mbridge.core import LLMBridge, register_model
from mbridge.core.safetensor_io import SafeTensorIO

from mcore_npu.integrations.mbridge_fixes import QWEN3_5_HUB_TYPES, QWEN3_5_TYPES
from mcore_npu.transformer.gated_delta_net import GDNTransformerConfig

MODEL_TYPES = tuple(t for t in QWEN3_5_TYPES if t not in QWEN3_5_HUB_TYPES)  # hub: .hf_qwen3_5_vl
HUB_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")
_SLICE = re.compile(r"^(.+)\[(\d+)\]$")  # a fused expert tensor's row e: "name[e]"


def text_config(hf_config):
    """The language model's config: ``text_config`` of a hub (vision-language) config."""
    return getattr(hf_config, "text_config", None) or hf_config


def is_hub_form(hf_config) -> bool:
    """Whether the config is the vision-language one (weights under ``model.language_model.``)."""
    return getattr(hf_config, "text_config", None) is not None


def linear_attention_pattern(text) -> list[int]:
    """Megatron's ``linear_attention_freq`` list (1 = Gated DeltaNet, 0 = full attention)."""
    kinds = {"linear_attention": 1, "full_attention": 0}
    unknown = sorted({kind for kind in text.layer_types if kind not in kinds})
    if unknown:
        raise ValueError(
            f"layer_types: {unknown} are not Qwen3.5 layer kinds; the bridge builds "
            "'linear_attention' (Gated DeltaNet) and 'full_attention' layers only"
        )
    return [kinds[kind] for kind in text.layer_types]


def moe_layer_pattern(text) -> list[int]:
    """Megatron's ``moe_layer_freq`` list from ``mlp_only_layers`` / ``decoder_sparse_step``."""
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    return [int(i not in dense and (i + 1) % step == 0) for i in range(text.num_hidden_layers)]


def rope_keywords(text) -> dict:
    """``rotary_base`` and ``rotary_percent`` (GPTModel arguments) from ``rope_parameters``.

    Raises ``ValueError`` for a RoPE type other than the default (mRoPE sections are fine: with
    one position per token, as in text, all three rotate by the same angles).
    """
    rope = dict(getattr(text, "rope_parameters", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ValueError(
            f"rope_parameters.rope_type: {kind!r}; the Qwen3.5 bridge builds Megatron's plain "
            "RoPE (rotary_percent, rotary_base); use a checkpoint with rope_type 'default'"
        )
    theta = rope.get("rope_theta", getattr(text, "rope_theta", None))
    factor = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
    return {"rotary_base": theta, "rotary_percent": float(factor)}


def config_keywords(hf_config) -> dict:
    """The ``TransformerConfig`` keywords of a Qwen3.5 / Qwen3-Next Hugging Face config
    (``ValueError`` for attention biases, which Megatron's gated attention cannot hold)."""
    text = text_config(hf_config)
    if getattr(text, "attention_bias", False):
        raise ValueError(
            "attention_bias: True; Megatron's gated attention (attention_output_gate) has no "
            "q/k/v bias layout for it; use a checkpoint with attention_bias false"
        )
    keywords = dict(
        add_bias_linear=False,
        qk_layernorm=True,
        layernorm_zero_centered_gamma=True,
        attention_output_gate=True,
        kv_channels=text.head_dim,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=linear_attention_pattern(text),
        linear_conv_kernel_dim=text.linear_conv_kernel_dim,
        linear_key_head_dim=text.linear_key_head_dim,
        linear_value_head_dim=text.linear_value_head_dim,
        linear_num_key_heads=text.linear_num_key_heads,
        linear_num_value_heads=text.linear_num_value_heads,
        ffn_hidden_size=getattr(text, "intermediate_size", None),
    )
    if getattr(text, "num_experts", 0):
        keywords.update(_moe_keywords(text))
    return keywords


def _moe_keywords(text) -> dict:
    pattern = moe_layer_pattern(text)
    keywords = dict(
        num_moe_experts=text.num_experts,
        moe_router_topk=text.num_experts_per_tok,
        moe_ffn_hidden_size=text.moe_intermediate_size,
        moe_layer_freq=pattern if 0 in pattern else 1,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_router_pre_softmax=not getattr(text, "norm_topk_prob", True),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=text.router_aux_loss_coef,
        moe_grouped_gemm=True,
    )
    shared = int(getattr(text, "shared_expert_intermediate_size", 0) or 0)
    if shared:
        keywords.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return keywords


def out_norm_offset(models) -> float:
    """1.0 when the models' GDN ``out_norm`` has ``zero_centered_gamma=True``, else 0.0."""
    for model in models if isinstance(models, list | tuple) else [models]:
        for name, module in model.named_modules():
            if name.endswith("self_attention.out_norm"):
                return 1.0 if getattr(module, "zero_centered_gamma", False) else 0.0
    return 0.0


class SlicingSafeTensorIO(SafeTensorIO):
    """mbridge's reader; a name ``"x[e]"`` reads row ``e`` of tensor ``x`` (fused experts)."""

    def load_some_hf_weight(self, hf_weight_names: list[str]) -> dict:
        wanted = {name: _SLICE.match(name) for name in hf_weight_names}
        real = sorted({m.group(1) if m else name for name, m in wanted.items()})
        loaded = super().load_some_hf_weight(real)
        return {
            name: loaded[m.group(1)][int(m.group(2))] if m else loaded[name]
            for name, m in wanted.items()
        }


def collect_fused_expert(buffer: dict, name: str, e: int, weight: torch.Tensor, count: int):
    """mbridge exports one expert at a time: keep expert ``e`` of the fused tensor ``name`` in
    ``buffer``; ``([name], [stacked [E, ...]])`` once all ``count`` are there, else ``([], [])``."""
    experts = buffer.setdefault(name, {})
    experts[e] = weight
    if len(experts) < count:
        return [], []
    del buffer[name]
    return [name], [torch.stack([experts[i] for i in range(count)])]


@register_model(list(MODEL_TYPES))
class Qwen3_5Bridge(LLMBridge):
    """mbridge bridge for ``qwen3_5`` / ``qwen3_5_moe`` (and ``_text``) and ``qwen3_next``."""

    TransformerConfigClass = GDNTransformerConfig  # GDN under context parallelism too
    _CONFIG_MAPPING = {**LLMBridge._CONFIG_MAPPING, "ffn_hidden_size": ("intermediate_size", None)}

    def __init__(self, hf_config, *args, **kwargs):
        self.text = text_config(hf_config)
        self.prefix = HUB_PREFIX if is_hub_form(hf_config) else TEXT_PREFIX
        self.fused_experts = False  # the expert form of the checkpoint last loaded
        self.out_norm_offset = 0.0  # 1.0 when the model's GDN out_norm is zero-centred
        self._expert_buffer: dict[str, dict[int, torch.Tensor]] = {}
        super().__init__(hf_config, *args, **kwargs)

    def _build_config(self):
        key = "text_config" if is_hub_form(self.hf_config) else None
        return self._build_base_config(text_config_key=key, **config_keywords(self.hf_config))

    def _get_gptmodel_args(self) -> dict:
        return dict(
            vocab_size=self.text.vocab_size,
            max_sequence_length=self.text.max_position_embeddings,
            position_embedding_type="rope",
            **rope_keywords(self.text),
        )

    @property
    def _gdn_sections(self) -> tuple[int, ...]:
        """Row counts of ``in_proj``: ``q, k, v, z, beta, alpha`` (whole model)."""
        text = self.text
        qk = text.linear_num_key_heads * text.linear_key_head_dim
        v = text.linear_num_value_heads * text.linear_value_head_dim
        heads = text.linear_num_value_heads
        return (qk, qk, v, v, heads, heads)

    def load_weights(self, models, weights_path: str, memory_efficient: bool = False) -> None:
        self.out_norm_offset = out_norm_offset(models)
        super().load_weights(models, weights_path, memory_efficient=memory_efficient)

    def export_weights(self, models):
        self.out_norm_offset = out_norm_offset(models)
        yield from super().export_weights(models)

    def _get_safetensor_io(self, weights_path: str):
        io = SlicingSafeTensorIO(self._get_actual_hf_path(weights_path))
        names = io.load_hf_weight_names()
        self.fused_experts = any(name.endswith("mlp.experts.gate_up_proj") for name in names)
        for prefix in (HUB_PREFIX, TEXT_PREFIX):  # the checkpoint's own prefix wins
            if any(name.startswith(f"{prefix}layers.") for name in names):
                self.prefix = prefix
                break
        return io

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        """Hugging Face names of one Megatron (global) name (``ValueError`` if none)."""
        top = {
            "embedding.word_embeddings.weight": f"{self.prefix}embed_tokens.weight",
            "decoder.final_layernorm.weight": f"{self.prefix}norm.weight",
            "output_layer.weight": "lm_head.weight",
        }
        if mcore_weights_name in top:
            return [top[mcore_weights_name]]
        match = _LAYER.match(mcore_weights_name)
        names = None if match is None else self._layer_names(match.group(2))
        if names is None:
            raise ValueError(
                f"{mcore_weights_name}: no Hugging Face tensor of {self.hf_config.model_type} "
                "maps to this Megatron parameter; build the model through this bridge "
                "(NPU spec, param_layout='te', moe_grouped_gemm=True)"
            )
        layer = f"{self.prefix}layers.{match.group(1)}."
        return [layer + name for name in names]

    def _layer_names(self, rest: str) -> list[str] | None:
        """Hugging Face names (after ``{P}layers.{i}.``) of a layer's Megatron parameter."""
        expert = _EXPERT.match(rest)
        if expert:
            which, e = expert.groups()
            if self.fused_experts:
                return [f"mlp.experts.{'gate_up_proj' if which == '1' else 'down_proj'}[{e}]"]
            projections = ("gate_proj", "up_proj") if which == "1" else ("down_proj",)
            return [f"mlp.experts.{e}.{p}.weight" for p in projections]
        if rest == "self_attention.in_proj.weight":
            if self.hf_config.model_type == "qwen3_next":
                return ["linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"]
            return [f"linear_attn.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")]
        return _LAYER_MAP.get(rest)

    def _weight_to_mcore_format(self, mcore_weights_name: str, hf_weights: list[torch.Tensor]):
        """Hugging Face tensors -> the Megatron tensor (whole model, before the TP split)."""
        if self.dtype is not None:
            hf_weights = [w.to(self.dtype) for w in hf_weights]
        name = mcore_weights_name
        if name.endswith("self_attention.linear_qkv.weight"):
            return self._gated_qkv(*hf_weights)
        if name.endswith("self_attention.in_proj.weight"):
            if len(hf_weights) == 2:
                return self._deinterleave_qwen3_next(*hf_weights)
            return torch.cat(hf_weights, dim=0)
        if name.endswith("self_attention.out_norm.weight") and self.out_norm_offset:
            return hf_weights[0] - self.out_norm_offset
        return super()._weight_to_mcore_format(name, hf_weights)

    def _weight_to_hf_format(self, mcore_weights_name: str, mcore_weights: torch.Tensor):
        """The Megatron tensor (whole model, after the TP merge) -> Hugging Face tensors."""
        names = self._weight_name_mapping_mcore_to_hf(mcore_weights_name)
        name = mcore_weights_name
        if name.endswith("self_attention.linear_qkv.weight"):
            return names, list(self._split_gated_qkv(mcore_weights))
        if name.endswith("self_attention.in_proj.weight"):
            if len(names) == 2:
                return names, list(self._interleave_qwen3_next(mcore_weights))
            return names, list(torch.split(mcore_weights, self._qkv_zba_rows(), dim=0))
        if name.endswith("self_attention.out_norm.weight") and self.out_norm_offset:
            return names, [mcore_weights + self.out_norm_offset]
        slice_match = _SLICE.match(names[0])
        if slice_match:
            return self._fused_expert(
                slice_match.group(1), int(slice_match.group(2)), mcore_weights
            )
        return super()._weight_to_hf_format(name, mcore_weights)

    def _qkv_zba_rows(self) -> list[int]:
        q, k, v, z, b, a = self._gdn_sections
        return [q + k + v, z, b, a]

    def _fused_expert(self, name: str, e: int, weight: torch.Tensor):
        """Collect expert ``e`` of a fused tensor (:func:`collect_fused_expert`)."""
        return collect_fused_expert(
            self._expert_buffer, name, e, weight, self.config.num_moe_experts
        )

    def _gated_qkv(self, q_proj, k_proj, v_proj) -> torch.Tensor:
        """q_proj ``[np*2*hn, H]`` (per head ``[q_h | gate_h]``), k/v ``[ng*hn, H]`` ->
        Megatron's ``[ng * (2*np/ng + 2) * hn, H]``, per group ``[q heads | gates | k | v]``."""
        text, hidden = self.text, q_proj.shape[-1]
        heads, groups, dim = text.num_attention_heads, text.num_key_value_heads, text.head_dim
        per = heads // groups
        q_gate = q_proj.view(groups, per, 2, dim, hidden)
        query = q_gate[:, :, 0].reshape(groups, per * dim, hidden)
        gate = q_gate[:, :, 1].reshape(groups, per * dim, hidden)
        key, value = k_proj.view(groups, dim, hidden), v_proj.view(groups, dim, hidden)
        return torch.cat([query, gate, key, value], dim=1).reshape(-1, hidden).contiguous()

    def _split_gated_qkv(self, qkv: torch.Tensor):
        """The inverse of :meth:`_gated_qkv`: ``(q_proj, k_proj, v_proj)``."""
        text, hidden = self.text, qkv.shape[-1]
        heads, groups, dim = text.num_attention_heads, text.num_key_value_heads, text.head_dim
        per = heads // groups
        grouped = qkv.view(groups, (2 * per + 2) * dim, hidden)
        query, gate, key, value = torch.split(grouped, [per * dim, per * dim, dim, dim], dim=1)
        q_gate = torch.stack(
            [query.reshape(groups, per, dim, hidden), gate.reshape(groups, per, dim, hidden)],
            dim=2,
        )  # [ng, np/ng, 2, hn, H]
        return tuple(t.reshape(-1, hidden).contiguous() for t in (q_gate, key, value))

    def _qwen3_next_groups(self):
        text = self.text
        groups, ratio = (
            text.linear_num_key_heads,
            text.linear_num_value_heads // text.linear_num_key_heads,
        )
        return groups, text.linear_key_head_dim, ratio * text.linear_value_head_dim, ratio

    def _deinterleave_qwen3_next(self, qkvz: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
        """Qwen3-Next's ``in_proj_qkvz`` (per key head ``[q | k | v | z]``) and ``in_proj_ba``
        (per key head ``[b | a]``) -> Megatron's ``[q | k | v | z | beta | alpha]``."""
        groups, dk, dv, ratio = self._qwen3_next_groups()
        hidden = qkvz.shape[-1]
        q, k, v, z = torch.split(qkvz.view(groups, -1, hidden), [dk, dk, dv, dv], dim=1)
        b, a = torch.split(ba.view(groups, 2 * ratio, hidden), [ratio, ratio], dim=1)
        parts = (q, k, v, z, b, a)
        return torch.cat([p.reshape(-1, hidden) for p in parts], dim=0).contiguous()

    def _interleave_qwen3_next(self, in_proj: torch.Tensor):
        """The inverse of :meth:`_deinterleave_qwen3_next`: ``(in_proj_qkvz, in_proj_ba)``."""
        groups, dk, dv, ratio = self._qwen3_next_groups()
        hidden = in_proj.shape[-1]
        sections = torch.split(in_proj, list(self._gdn_sections), dim=0)
        q, k, v, z, b, a = (part.reshape(groups, -1, hidden) for part in sections)
        qkvz = torch.cat([q, k, v, z], dim=1).reshape(-1, hidden).contiguous()
        ba = torch.cat([b, a], dim=1).reshape(-1, hidden).contiguous()
        return qkvz, ba

    def _sections(self, mcore_weights_name: str) -> tuple[int, ...] | None:
        """Row sections that each TP rank holds a slice of (``in_proj``, ``conv1d``)."""
        if mcore_weights_name.endswith("self_attention.in_proj.weight"):
            return self._gdn_sections
        if mcore_weights_name.endswith("self_attention.conv1d.weight"):
            return self._gdn_sections[:3]
        return None

    def _weight_split_across_tp(self, mcore_weights_name, mcore_weights, param, tp_split_size):
        sections = self._sections(mcore_weights_name)
        if sections is None or tp_split_size == 1:
            return super()._weight_split_across_tp(
                mcore_weights_name, mcore_weights, param, tp_split_size
            )
        chunks = [part.chunk(tp_split_size) for part in torch.split(mcore_weights, sections)]
        return [torch.cat([c[r] for c in chunks]) for r in range(tp_split_size)]

    def _weight_merge_across_tp(self, mcore_weights_name, mcore_weights, param):
        sections = self._sections(mcore_weights_name)
        if self.mpu.tp_size == 1:
            return mcore_weights[0]
        if sections is None:
            if mcore_weights_name.endswith(("self_attention.A_log", "self_attention.dt_bias")):
                return torch.cat(mcore_weights, dim=0)
            return super()._weight_merge_across_tp(mcore_weights_name, mcore_weights, param)
        tp = len(mcore_weights)
        local = [s // tp for s in sections]
        per_rank = [torch.split(w, local) for w in mcore_weights]
        return torch.cat([torch.cat([parts[i] for parts in per_rank]) for i in range(len(local))])


# Megatron name after ``decoder.layers.{i}.`` -> Hugging Face names after ``{P}layers.{i}.``
_LAYER_MAP = {
    "self_attention.in_proj.layer_norm_weight": ["input_layernorm.weight"],
    "self_attention.conv1d.weight": ["linear_attn.conv1d.weight"],
    "self_attention.A_log": ["linear_attn.A_log"],
    "self_attention.dt_bias": ["linear_attn.dt_bias"],
    "self_attention.out_norm.weight": ["linear_attn.norm.weight"],
    "self_attention.out_proj.weight": ["linear_attn.out_proj.weight"],
    "self_attention.linear_qkv.layer_norm_weight": ["input_layernorm.weight"],
    "self_attention.linear_qkv.weight": [f"self_attn.{p}_proj.weight" for p in "qkv"],
    "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
    "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
    "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
    "mlp.linear_fc1.layer_norm_weight": ["post_attention_layernorm.weight"],
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    "mlp.router.weight": ["mlp.gate.weight"],
    "mlp.shared_experts.linear_fc1.weight": [
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
    ],
    "mlp.shared_experts.linear_fc2.weight": ["mlp.shared_expert.down_proj.weight"],
    "mlp.shared_experts.gate_weight": ["mlp.shared_expert_gate.weight"],
}
