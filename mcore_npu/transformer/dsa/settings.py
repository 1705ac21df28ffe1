"""A DSA layer's settings, read once from Megatron's config and the NPU spec keywords for what
megatron-core 0.16.1's config lacks (0.19's field names), and the limits checked at build."""

from __future__ import annotations

import dataclasses

from mcore_npu.transformer import megatron_features
from mcore_npu.transformer.norms import check_epsilon

DSA = "dsa"
SPEC_KEYWORDS = (
    "dsa_indexer_rope_interleaved",
    "dsa_indexer_k_norm_epsilon",
    "dsa_indexer_topk_freq",
    "dsa_indexer_skip_topk_offset",
)


def is_dsa(config) -> bool:
    """Whether ``config`` (a config, or its fields as a dict) asks for DSA layers."""
    if isinstance(config, dict):
        return config.get("experimental_attention_variant") == DSA
    return getattr(config, "experimental_attention_variant", None) == DSA


@dataclasses.dataclass(frozen=True)
class DSASettings:
    """heads / head_dim / topk: the indexer's (``dsa_indexer_*``); loss_coeff: the indexer KL
    loss's weight (0: the indexer runs without grad); sparse_loss: the loss over the selected
    keys only; rope_interleaved: the indexer's RoPE on interleaved pairs (GLM-5) or halves
    (DeepSeek-V3.2); k_norm_eps: the indexer key LayerNorm's epsilon; topk_freq /
    skip_offset: 0.19's top-k sharing (:meth:`source_layer`)."""

    heads: int
    head_dim: int
    topk: int
    loss_coeff: float = 0.0
    sparse_loss: bool = False
    rope_interleaved: bool = False
    k_norm_eps: float = 1e-6
    topk_freq: int = 1
    skip_offset: int = 0

    @property
    def trains_indexer(self) -> bool:
        return self.loss_coeff > 0

    @property
    def shares_topk(self) -> bool:
        return self.topk_freq > 1

    def source_layer(self, layer_number: int) -> int:
        """The layer (1-based) whose top-k layer ``layer_number`` uses: itself where it runs
        its indexer, else the last such layer before it (Megatron 0.19's rule: past the first
        ``max(skip_offset, 1)`` layers, every ``topk_freq``-th runs it; GLM-5's ``shared``)."""
        offset = max(self.skip_offset, 1)
        if layer_number <= offset:
            return layer_number
        return layer_number - (layer_number - offset) % self.topk_freq


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: {value!r}; DSA needs a positive int (set it in the config)")
    return value


def dsa_settings(
    config, rope_interleaved=None, k_norm_epsilon=None, topk_freq=None, skip_topk_offset=None
) -> DSASettings:
    """The settings of ``config`` (which :func:`is_dsa`); the keywords override the config's
    0.19 fields (None: the field, else False / ``layernorm_epsilon`` / 1 / 0). ValueError naming
    the field for what the NPU DSA layer does not build."""
    check_spec_keywords(rope_interleaved, k_norm_epsilon, topk_freq, skip_topk_offset)
    if rope_interleaved is None:
        rope_interleaved = getattr(config, "dsa_indexer_rope_interleaved", False)
    if k_norm_epsilon is None:
        k_norm_epsilon = getattr(config, "dsa_indexer_k_norm_epsilon", None)
    if k_norm_epsilon is None:
        k_norm_epsilon = config.layernorm_epsilon
    if topk_freq is None:
        topk_freq = getattr(config, "dsa_indexer_topk_freq", None) or 1
    if skip_topk_offset is None:
        skip_topk_offset = getattr(config, "dsa_indexer_skip_topk_offset", None) or 0
    check_dsa_config(config, topk_freq)
    coeff = config.dsa_indexer_loss_coeff or 0.0
    if coeff < 0:
        raise ValueError(f"dsa_indexer_loss_coeff: {coeff}; pass 0 (no indexer loss) or more")
    return DSASettings(
        heads=_positive_int("dsa_indexer_n_heads", config.dsa_indexer_n_heads),
        head_dim=_positive_int("dsa_indexer_head_dim", config.dsa_indexer_head_dim),
        topk=_positive_int("dsa_indexer_topk", config.dsa_indexer_topk),
        loss_coeff=float(coeff),
        sparse_loss=bool(config.dsa_indexer_use_sparse_loss),
        rope_interleaved=rope_interleaved,
        k_norm_eps=float(k_norm_epsilon),
        topk_freq=topk_freq,
        skip_offset=skip_topk_offset,
    )


def check_spec_keywords(rope_interleaved, k_norm_epsilon, topk_freq=None, skip_offset=None):
    """The spec keywords' types (None: the config's), ValueError naming the keyword."""
    if rope_interleaved is not None and not isinstance(rope_interleaved, bool):
        raise ValueError(
            f"dsa_indexer_rope_interleaved: pass True, False or None, got {rope_interleaved!r}"
        )
    check_epsilon("dsa_indexer_k_norm_epsilon", k_norm_epsilon)
    for name, value, least in (
        ("dsa_indexer_topk_freq", topk_freq, 1),
        ("dsa_indexer_skip_topk_offset", skip_offset, 0),
    ):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < least
        ):
            raise ValueError(f"{name}: pass an int >= {least} or None, got {value!r}")


def check_dsa_config(config, topk_freq: int = 1) -> None:
    """ValueError naming the field, and what to do, for a DSA config the NPU layer refuses."""
    if not config.multi_latent_attention:
        raise ValueError(
            "multi_latent_attention: False with experimental_attention_variant='dsa'; DSA is "
            "MLA with an indexer: set multi_latent_attention=True"
        )
    rope = config.qk_pos_emb_head_dim
    if (config.dsa_indexer_head_dim or 0) < rope:
        raise ValueError(
            f"dsa_indexer_head_dim: {config.dsa_indexer_head_dim}, smaller than the RoPE part "
            f"qk_pos_emb_head_dim={rope}; the indexer head is [pe, nope]: make it at least {rope}"
        )
    if topk_freq > 1 and config.pipeline_model_parallel_size > 1:
        raise ValueError(
            f"dsa_indexer_topk_freq: {topk_freq} with pipeline_model_parallel_size="
            f"{config.pipeline_model_parallel_size}; a layer reusing an earlier layer's top-k "
            "takes it within its own pipeline stage only: set the frequency to 1 or train "
            "without pipeline parallelism"
        )
    if not getattr(config, "dsa_indexer_scoring_relu", True):
        raise ValueError(
            "dsa_indexer_scoring_relu: False; the NPU lightning indexer scores with ReLU: set it "
            "to True"
        )


def loss_scaler():
    """The autograd function that adds the indexer loss to the backward at the schedule's scale
    (``loss_scale · CP / micro-batches``; ``loss_scale`` with ``calculate_per_token_loss``):
    Megatron's ``DSAIndexerLossAutoScaler`` where the schedules scale it (0.19+, for configs
    with ``experimental_attention_variant='dsa'``), else ``MoEAuxLossAutoScaler``, which they
    scale for MoE models (a model without MoE layers: scale 1 there, as Megatron's own DSA
    gets). docs/dsa.md#training-the-indexer."""
    if megatron_features.has("schedule_scales_dsa_loss"):
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossAutoScaler,
        )

        return DSAIndexerLossAutoScaler
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    return MoEAuxLossAutoScaler


def check_cp_comm_type(comm_type: str) -> None:
    """DSA layers gather the keys over CP ranks: ``all_gather`` only."""
    if comm_type != "all_gather":
        raise ValueError(
            f"cp_comm_type: {comm_type!r} for a DSA layer; its keys are all-gathered over the CP "
            "ranks (MindSpeed's kvallgather_cp_algo): set cp_comm_type='all_gather'"
        )
