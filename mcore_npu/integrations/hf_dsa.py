"""The plugin's mbridge bridge for DeepSeek Sparse Attention checkpoints: GLM-5
(``model_type: glm_moe_dsa``) and DeepSeek-V3.2 (``deepseek_v32``).

:class:`DSABridge` is the plugin's DeepSeek-V3 bridge registered for both types, plus the DSA
config (``experimental_attention_variant="dsa"``, the indexer's sizes, ``moe_layer_freq`` from
``mlp_layer_types``), the NPU decoder-block spec with the checkpoint's DSA spec keywords, the
indexer's four tensors per layer (:data:`LAYER_MAP`), GLM-5's top-k sharing
(:func:`topk_sharing`) and the MTP layers (``model.layers.{num_hidden_layers + i}.*``). Every
tensor is moved, never changed: export is bit-exact. What it does not build is refused naming
the Hugging Face field. Design and the field-by-field map: docs/hf_weights.md.
"""

from __future__ import annotations

import re

from mbridge.core import register_model
from mbridge.models.deepseek_v3 import DeepseekV3Bridge

from mcore_npu.integrations.mbridge_fixes import DSA_TYPES, fixed_bridge_class, mbridge_expert_form
from mcore_npu.transformer.dsa import DSASettings, DSATransformerConfig

MODEL_TYPES = DSA_TYPES
INDEXER_K_NORM_EPS = 1e-6  # transformers 5.25: nn.LayerNorm(index_head_dim, eps=1e-6)
LATENT_NORM_EPS = 1e-6  # transformers 5.25: the q / kv latent RMSNorms' default, any rms_norm_eps
# model_type -> whether the indexer rotates its rope slice in interleaved pairs (transformers 5.25:
# GlmMoeDsaIndexer apply_rotary_pos_emb_interleave, DeepseekV32Indexer apply_rotary_pos_emb)
INDEXER_ROPE_INTERLEAVED = {"glm_moe_dsa": True, "deepseek_v32": False}
MLP_LAYER_TYPES = {"dense": 0, "sparse": 1}

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron name after ``decoder.layers.{i}.`` -> Hugging Face name after ``model.layers.{i}.``
LAYER_MAP = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    # the lightning indexer
    "self_attention.core_attention.indexer.linear_wq_b.weight": "self_attn.indexer.wq_b.weight",
    "self_attention.core_attention.indexer.linear_wk.weight": "self_attn.indexer.wk.weight",
    "self_attention.core_attention.indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "self_attention.core_attention.indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "self_attention.core_attention.indexer.linear_weights_proj.weight": (
        "self_attn.indexer.weights_proj.weight"
    ),
}


def _refuse(field: str, value, why: str) -> None:
    raise ValueError(f"{field}: {value!r}; {why}")


def check_supported(hf_config) -> None:
    """``ValueError`` naming the Hugging Face field for what the plugin's DSA model cannot hold or
    compute (the MoE routing and RoPE checks are the DeepSeek-V3 bridge's, when it builds)."""
    h = hf_config
    topk_sharing(h)  # refuses an indexer_types pattern Megatron's rule cannot write
    if getattr(h, "attention_bias", False):
        _refuse(
            "attention_bias",
            True,
            "Megatron's MLA projections have no bias (add_bias_linear=False); use a checkpoint "
            "without attention biases",
        )
    if getattr(h, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", h.hidden_act, "the bridge builds SwiGLU MLPs and experts ('silu')")
    if getattr(h, "q_lora_rank", None) is None:
        _refuse(
            "q_lora_rank",
            None,
            "the DSA indexer reads the query latent (q_a_layernorm(q_a_proj(x))); MLA without a "
            "query down projection has none",
        )
    heads, groups = h.num_attention_heads, getattr(h, "num_key_value_heads", None)
    if groups is not None and groups != heads:
        _refuse(
            "num_key_value_heads",
            groups,
            f"MLA has a key and a value per head: num_attention_heads ({heads})",
        )
    kinds = list(getattr(h, "mlp_layer_types", None) or [])
    unknown = sorted({kind for kind in kinds if kind not in MLP_LAYER_TYPES})
    if unknown:
        _refuse("mlp_layer_types", unknown, "each layer is 'dense' or 'sparse' (MoE)")
    if kinds and len(kinds) != h.num_hidden_layers:
        _refuse(
            "mlp_layer_types",
            f"{len(kinds)} entries",
            f"one per layer: num_hidden_layers = {h.num_hidden_layers}",
        )


def topk_sharing(hf_config) -> tuple[int, int]:
    """``(dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset)`` whose Megatron 0.19 rule gives
    the checkpoint's ``indexer_types`` (``"full"``: the layer runs its indexer; ``"shared"``: it
    reuses the last full layer's top-k); ``(1, 0)`` where every layer is full. ``ValueError``
    naming ``indexer_types`` for a pattern the rule cannot write."""
    kinds = list(getattr(hf_config, "indexer_types", None) or [])
    unknown = sorted(set(kinds) - {"full", "shared"})
    if unknown:
        _refuse("indexer_types", unknown, "each layer is 'full' or 'shared'")
    if all(kind == "full" for kind in kinds):
        return 1, 0
    offset = kinds.index("shared")  # the leading full layers
    later = [i for i in range(offset, len(kinds)) if kinds[i] == "full"]  # 0-based
    freq = later[0] - offset + 1 if later else len(kinds) - offset + 1
    if offset >= 1 and _sharing_pattern(len(kinds), freq, offset) == kinds:
        return freq, offset
    _refuse(
        "indexer_types",
        kinds,
        "Megatron's top-k sharing (dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset) runs "
        "the indexer in the first layers and then every freq-th; this pattern is not one of "
        "those: use a checkpoint whose pattern is",
    )


def _sharing_pattern(layers: int, freq: int, offset: int) -> list[str]:
    """``indexer_types`` by Megatron 0.19's rule (:meth:`DSASettings.source_layer`)."""
    settings = DSASettings(heads=1, head_dim=1, topk=1, topk_freq=freq, skip_offset=offset)
    full = [settings.source_layer(n) == n for n in range(1, layers + 1)]
    return ["full" if f else "shared" for f in full]


def moe_layer_freq(hf_config) -> list[int]:
    """Megatron's ``moe_layer_freq`` (1 = MoE) from ``mlp_layer_types``, else from
    ``first_k_dense_replace`` (the first k dense)."""
    kinds = list(getattr(hf_config, "mlp_layer_types", None) or [])
    if kinds:
        return [MLP_LAYER_TYPES[kind] for kind in kinds]
    layers = hf_config.num_hidden_layers
    dense = min(int(getattr(hf_config, "first_k_dense_replace", 0) or 0), layers)
    return [0] * dense + [1] * (layers - dense)


def dsa_keywords(hf_config) -> dict:
    """The DSA ``TransformerConfig`` keywords of a Hugging Face config (the DeepSeek-V3 ones
    come from the DeepSeek-V3 bridge)."""
    check_supported(hf_config)
    return dict(
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=hf_config.index_n_heads,
        dsa_indexer_head_dim=hf_config.index_head_dim,
        dsa_indexer_topk=hf_config.index_topk,
        dsa_indexer_loss_coeff=0.0,
        moe_layer_freq=moe_layer_freq(hf_config),
    )


def dsa_spec_keywords(hf_config) -> dict:
    """The NPU spec's keywords for this checkpoint: the indexer's RoPE layout and key-norm eps
    (megatron-core 0.16.1's config has neither field; 0.19's names), and the latent norms' eps."""
    model_type = hf_config.model_type
    if model_type not in INDEXER_ROPE_INTERLEAVED:
        raise ValueError(
            f"model_type: {model_type!r} is not a DSA checkpoint the plugin bridges (those: "
            f"{', '.join(INDEXER_ROPE_INTERLEAVED)})"
        )
    freq, offset = topk_sharing(hf_config)
    return dict(
        dsa_indexer_rope_interleaved=INDEXER_ROPE_INTERLEAVED[model_type],
        dsa_indexer_k_norm_epsilon=INDEXER_K_NORM_EPS,
        dsa_indexer_topk_freq=freq,
        dsa_indexer_skip_topk_offset=offset,
        mla_latent_norm_epsilon=LATENT_NORM_EPS,
    )


MTP_DIRECT = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
"""Megatron name after ``mtp.layers.{i}.`` -> Hugging Face name after ``model.layers.{L + i}.``
(``L``: ``num_hidden_layers``); the MTP layer's transformer layer maps as decoder layer L + i."""
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_COPY = re.compile(r"^model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")


@register_model(list(MODEL_TYPES))
class DSABridge(fixed_bridge_class("deepseek_v3")):
    """mbridge bridge for ``glm_moe_dsa`` and ``deepseek_v32``: the plugin's DeepSeek-V3 bridge
    with the DSA config, the NPU spec's DSA layer and the indexer's weights."""

    TransformerConfigClass = DSATransformerConfig  # DSA under context parallelism too
    own_npu_spec = True  # hf.use_npu_spec / the verl engine hand over the kernel and keywords
    npu_mtp = True  # its MTP layers come from the NPU spec (_model_provider)
    mtp_copies: frozenset = frozenset()  # the loaded checkpoint's MTP copies of embedding / head
    npu_spec_keywords: dict = {}  # the NPU engine's recipe spec keywords (replaced, not mutated)
    npu_kernel = "auto"

    def _build_base_config(self, text_config_key=None, **keywords):
        keywords = {**keywords, **dsa_keywords(self.hf_config)}
        return super()._build_base_config(text_config_key=text_config_key, **keywords)

    def _spec_keywords(self) -> dict:
        """The NPU spec's keywords of this checkpoint and engine; the TE layout always (the
        names this bridge maps)."""
        return {
            "kernel": self.npu_kernel,
            **mbridge_expert_form(self.config),
            **dsa_spec_keywords(self.hf_config),
            **self.npu_spec_keywords,
            "param_layout": "te",
        }

    def _get_transformer_layer_spec(self, vp_stage=None):
        from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

        return get_gpt_decoder_block_npu_spec(
            self.config,
            normalization=self.config.normalization,
            vp_stage=vp_stage,
            **self._spec_keywords(),
        )

    def _model_provider(self, post_model_creation_callbacks):
        """GPTModel with the NPU decoder block and, with ``mtp_num_layers``, the NPU spec's MTP
        block (mbridge's DeepSeek provider would build TE's)."""
        from megatron.core.models.gpt import GPTModel

        from mcore_npu.integrations.bridge_provider import model_provider
        from mcore_npu.transformer.layer_specs import get_gpt_mtp_block_npu_spec
        from mcore_npu.transformer.spec_provider import OPTION_NAMES

        def build(pre_process, post_process, vp_stage):
            block = self._get_transformer_layer_spec(vp_stage)
            args = self._get_gptmodel_args()
            if vp_stage is not None:
                args["vp_stage"] = vp_stage
            options = {k: v for k, v in self._spec_keywords().items() if k in OPTION_NAMES}
            mtp = get_gpt_mtp_block_npu_spec(self.config, block, vp_stage=vp_stage, **options)
            if mtp is not None:
                args["mtp_block_spec"] = mtp
            tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))
            return GPTModel(config=self.config, transformer_layer_spec=block,
                            pre_process=pre_process, post_process=post_process,
                            share_embeddings_and_output_weights=tied, **args)  # fmt: skip

        return model_provider(self, build, post_model_creation_callbacks)

    def _convert_mtp_param(self, name: str) -> list[str]:
        """Hugging Face names of an MTP parameter: ``mtp.layers.{i}.*`` is the checkpoint's
        ``model.layers.{num_hidden_layers + i}.*`` (:data:`MTP_DIRECT`, its transformer layer as
        a decoder layer of that number)."""
        match = _MTP.match(name)
        inner = match and match.group(2).removeprefix("transformer_layer.")
        if match is None or (inner == match.group(2) and inner not in MTP_DIRECT):
            raise ValueError(
                f"{name}: no Hugging Face tensor of an MTP layer maps to it (those: "
                f"mtp.layers.<i>.{{{', '.join(MTP_DIRECT)}}} and .transformer_layer.*); build "
                "the model through this bridge's provider"
            )
        layer = self.hf_config.num_hidden_layers + int(match.group(1))
        if inner in MTP_DIRECT:
            return [f"model.layers.{layer}.{MTP_DIRECT[inner]}"]
        return self._weight_name_mapping_mcore_to_hf(f"decoder.layers.{layer}.{inner}")

    def _get_safetensor_io(self, weights_path: str):
        """The reader of the checkpoint; notes which copies of the embedding and output layer
        its MTP layers carry (:meth:`_weight_to_hf_format` writes back exactly those)."""
        io = super()._get_safetensor_io(weights_path)
        self.mtp_copies = frozenset(n for n in io.load_hf_weight_names() if _MTP_COPY.match(n))
        return io

    def _weight_to_hf_format(self, name: str, tensor):
        """The Hugging Face names and tensors of one Megatron tensor; with MTP on, the
        embedding and output layer also under the MTP layers' copies the loaded checkpoint
        holds (``model.layers.{L + i}.embed_tokens`` / ``shared_head.head``: DeepSeek's releases
        carry them, some GLM-5 releases not), none for a bridge that loaded none."""
        names, tensors = super(DeepseekV3Bridge, self)._weight_to_hf_format(name, tensor)
        leaf = {"embedding.word_embeddings.weight": "embed_tokens.weight",
                "output_layer.weight": "shared_head.head.weight"}.get(name)  # fmt: skip
        if leaf is None or not self.config.mtp_num_layers:
            return names, tensors
        first = self.hf_config.num_hidden_layers
        copies = [f"model.layers.{first + i}.{leaf}" for i in range(self.config.mtp_num_layers)]
        copies = [c for c in copies if c in self.mtp_copies]
        return [*names, *copies], [*tensors, *[tensor] * len(copies)]

    def _weight_name_mapping_attention(self, name: str) -> list[str]:
        """Hugging Face names of one layer's attention tensor (``ValueError`` if none)."""
        match = _LAYER.match(name)
        hf = None if match is None else LAYER_MAP.get(match.group(2))
        if hf is None:
            raise ValueError(
                f"{name}: no Hugging Face tensor of {self.hf_config.model_type} maps to this "
                "Megatron parameter; build the model through this bridge (the NPU spec's DSA "
                "layer, param_layout='te')"
            )
        return [f"model.layers.{match.group(1)}.{hf}"]
