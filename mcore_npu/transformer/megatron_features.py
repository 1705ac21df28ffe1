"""What the installed megatron-core has: every feature this package reads from it, in one place.

:data:`FEATURES` names each difference between the admitted releases (0.15 to 0.19) with the
releases that have it; :func:`has` answers from the installed objects, never from a version string.
:data:`FIELDS_SINCE` and :data:`REMOVED_AFTER` word a refusal of a ``TransformerConfig`` field the
installed release lacks."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

FIELDS_SINCE: dict[str, tuple[str, ...]] = {
    "0.16": ("attention_output_gate", "batch_invariant_mode", "dsa_indexer_head_dim",
        "dsa_indexer_loss_coeff", "dsa_indexer_n_heads", "dsa_indexer_topk",
        "dsa_indexer_use_sparse_loss", "ep_overlap_early_attn_memory_release",
        "experimental_attention_variant", "fine_grained_activation_offloading",
        "fp4_quantizer_factory", "fp8_quantizer_factory", "hybrid_context_parallel",
        "inference_fuse_tp_communication", "kitchen_attention_backend", "linear_attention_freq",
        "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "linear_value_head_dim", "log_max_attention_logit",
        "max_seqlen_per_dp_cp_rank", "min_offloaded_tensor_size", "moe_enable_routing_replay",
        "moe_flex_dispatcher_backend", "moe_hybridep_num_sms", "moe_latent_size",
        "moe_router_padding_for_quantization", "moe_shared_expert_gate", "mtp_standalone",
        "offload_modules", "qk_clip", "qk_clip_alpha", "qk_clip_threshold", "qk_l2_norm",
        "use_inference_optimized_layers", "use_kitchen_attention"),
    "0.17": ("cpu_offloading_retain_pinned_cpu_buffers", "fused_residual_rmsnorm",
        "inference_disable_triton_nvls_kernels", "inference_grouped_gemm_backend",
        "inference_moe_disable_fused_quant_kernels", "moe_hybridep_num_blocks_permute",
        "moe_hybridep_num_blocks_unpermute", "moe_pad_experts_for_cuda_graph_inference",
        "moe_permute_fusion_into_hybridep", "moe_router_force_biased",
        "mtp_hybrid_override_pattern", "mtp_use_repeated_layer", "mup_attn_scale_power",
        "mup_base_head_dim", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult",
        "mup_width_mult", "nccl_all_reduce_for_prefill", "use_mup"),
    "0.18": ("cuda_graph_modules", "fine_grained_offloading_max_inflight_offloads",
        "fp8_output_proj", "high_priority_a2a_comm_stream", "inference_cuda_graph_scope",
        "inference_moe_token_dispatcher_type", "mlp_chunks_for_training",
        "moe_expert_rank_capacity_factor", "moe_hybridep_num_sms_preprocessing",
        "moe_mlp_glu_interleave_size", "moe_paged_stash", "moe_paged_stash_buffer_size_factor_cpu",
        "moe_paged_stash_buffer_size_factor_cuda", "moe_paged_stash_page_size",
        "moe_single_grouped_bias", "moe_single_grouped_weight",
        "overlap_dispatch_backward_with_experts_wgrad", "use_grouped_gemm_for_dense_mlp",
        "use_transformer_engine_op_fuser"),
    "0.19": ("activation_offload_fraction", "delay_offload_until_cuda_graph",
        "delta_offload_bytes_across_pp_ranks", "dsa_indexer_k_norm_epsilon",
        "dsa_indexer_k_norm_fp32", "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation",
        "dsa_indexer_scoring_relu", "dsa_indexer_skip_topk_offset", "dsa_indexer_topk_freq",
        "dsa_kernel_backend", "experimental_attention_variant_loss_scale_func",
        "expert_gtp_weight_remat_size", "expert_tensor_parallel_num_weight_shards",
        "flash_attention_version", "gtp_weight_remat_size", "mamba_training_ssm_states_dtype",
        "moe_flex_dispatcher_num_sms", "moe_grad_scale_func",
        "moe_hybridep_pad_uneven_dispatch_inputs", "moe_ncclep_static_shape",
        "moe_ncclep_zero_copy", "moe_router_quantile_balancing_ema",
        "moe_shared_expert_glu_interleave_size", "mtp_detach_heads", "mtp_grad_scale_func",
        "tensor_parallel_num_weight_shards", "use_grouped_gemm_for_shared_expert"),
}  # fmt: skip
REMOVED_AFTER: dict[str, tuple[str, ...]] = {
    "0.16": ("async_tensor_model_parallel_allreduce", "moe_extended_tp",
        "moe_use_legacy_grouped_gemm"),
}  # fmt: skip


def version_with(field: str) -> str | None:
    """Which megatron-core has the ``TransformerConfig`` field ``field``, in words; None if unknown."""
    for since, names in FIELDS_SINCE.items():
        if field in names:
            return f"megatron-core {since}+"
    for last, names in REMOVED_AFTER.items():
        if field in names:
            major, minor = last.split(".")
            return f"megatron-core {last} (removed in {major}.{int(minor) + 1})"
    return None


def install_hint(field: str) -> str | None:
    """What to do about a field the installed megatron-core lacks (None if unknown)."""
    where = version_with(field)
    if where is None:
        return None
    return f"{where} has {field}: install that version, or remove the key"


@dataclass(frozen=True)
class Feature:
    """A difference between admitted releases: ``since`` the first that has it (None: 0.15),
    ``until`` the last (None: the newest still does); ``probe`` reads it."""

    what: str
    probe: Callable[[], bool]
    since: str | None = None
    until: str | None = None


def _attribute(module: str, name: str) -> object:
    return getattr(importlib.import_module(module), name, None)


def _parameters(module: str, name: str) -> set[str]:
    function = _attribute(module, name)
    return set(inspect.signature(function).parameters) if function is not None else set()


def _router_slot() -> bool:
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    return "router" in {f.name for f in dataclasses.fields(MoESubmodules)}


def _mla_returns_latents() -> bool:
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    return "q_compressed" in MultiLatentAttention.forward.__code__.co_varnames


def _mla_te_stand_in() -> bool:
    module = importlib.import_module("megatron.core.transformer.multi_latent_attention")
    linear = getattr(module, "TELinear", None)
    return bool(getattr(module, "HAVE_TE", False)) and not isinstance(linear, type)


def _experts_builder() -> bool:
    from megatron.core.models.backends import BackendSpecProvider

    legacy = "moe_use_legacy_grouped_gemm"
    return legacy not in inspect.signature(BackendSpecProvider.grouped_mlp_modules).parameters


_MOE = "megatron.core.transformer.moe"


def _router_expert_bias() -> bool:
    return hasattr(_attribute(f"{_MOE}.router", "TopKRouter"), "_apply_expert_bias")


def _grouped_mlp() -> bool:
    return isinstance(_attribute(f"{_MOE}.experts", "GroupedMLP"), type)


def _mlp_takes_name() -> bool:
    return "name" in _parameters("megatron.core.transformer.mlp", "MLP")


def _shared_expert_overlap_state() -> bool:
    return _attribute(f"{_MOE}.shared_experts", "overlap_state_check") is not None


def _checkpoint_groups() -> bool:
    utils = "megatron.core.transformer.utils"
    return "tp_group" in _parameters(utils, "make_sharded_tensors_for_checkpoint")


def _cp_batch_hybrid_flag() -> bool:
    return "is_hybrid_cp" in _parameters("megatron.core.utils", "get_batch_on_this_cp_rank")


def _hybrid_model() -> bool:
    return importlib.util.find_spec("megatron.core.models.hybrid") is not None


def _checkpoint_common_file() -> bool:
    return "common_strategy" in _parameters("megatron.core.dist_checkpointing", "save")


def _schedule_scales_dsa_loss() -> bool:
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    return "DSAIndexerLossAutoScaler" in inspect.getsource(schedules)


FEATURES: dict[str, Feature] = {
    "router_slot": Feature(
        "MoESubmodules has a router slot (before, MoELayer builds its TopKRouter)",
        _router_slot,
        since="0.16",
    ),
    "router_expert_bias": Feature(
        "TopKRouter._apply_expert_bias (before, routing adds the bias inline)",
        _router_expert_bias,
        since="0.16",
    ),
    "mla_returns_latents": Feature(
        "MLA's get_query_key_value_tensors also returns q_compressed and kv_compressed",
        _mla_returns_latents,
        since="0.16",
    ),
    "mla_te_stand_in": Feature(
        "without TE, MLA's module says HAVE_TE with a MagicMock TELinear (isinstance raises)",
        _mla_te_stand_in,
        until="0.16",
    ),
    "experts_builder": Feature(
        "BackendSpecProvider.grouped_mlp_modules returns an experts builder",
        _experts_builder,
        since="0.17",
    ),
    "grouped_mlp": Feature("the legacy GroupedMLP experts class", _grouped_mlp, until="0.16"),
    "mlp_takes_name": Feature("MLP.__init__ takes name", _mlp_takes_name, since="0.18"),
    "shared_expert_overlap_state": Feature(
        "shared_experts.overlap_state_check and SharedExpertState",
        _shared_expert_overlap_state,
        since="0.18",
    ),
    "checkpoint_groups": Feature(
        "make_sharded_tensors_for_checkpoint and sharded_state_dict_default take tp_group (and "
        "dp_cp_group); before, they read parallel_state's",
        _checkpoint_groups,
        since="0.16",
    ),
    "cp_batch_hybrid_flag": Feature(
        "get_batch_on_this_cp_rank takes is_hybrid_cp (positional, required)",
        _cp_batch_hybrid_flag,
        since="0.18",
    ),
    "hybrid_model": Feature(
        "megatron.core.models.hybrid: HybridModel and HybridStack (before, MambaModel and "
        "MambaStack in megatron.core.ssm)",
        _hybrid_model,
        since="0.18",
    ),
    "schedule_scales_dsa_loss": Feature(
        "the pipeline schedules set DSAIndexerLossAutoScaler's scale for DSA configs (before, "
        "only MoEAuxLossAutoScaler's, for MoE configs; 0.17-0.18 have the class unscaled)",
        _schedule_scales_dsa_loss,
        since="0.19",
    ),
    "checkpoint_common_file": Feature(
        "dist_checkpointing.save writes common.pt (after, the .distcp files hold common_state)",
        _checkpoint_common_file,
        until="0.18",
    ),
}


@functools.cache
def has(feature: str) -> bool:
    """Whether the installed megatron-core has ``feature`` (a key of :data:`FEATURES`)."""
    if feature not in FEATURES:
        raise ValueError(f"feature: {feature!r} is not one of {', '.join(FEATURES)}")
    return bool(FEATURES[feature].probe())


@functools.cache
def config_fields() -> frozenset[str]:
    """The installed ``TransformerConfig``'s field names."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return frozenset(f.name for f in dataclasses.fields(TransformerConfig))


def require_config_fields(owner: str, fields, what: str, since: str) -> None:
    """ValueError naming ``owner`` and the missing fields where the installed
    ``TransformerConfig`` lacks some of ``fields`` (``what`` came with megatron-core ``since``)."""
    missing = [name for name in fields if name not in config_fields()]
    if missing:
        raise ValueError(
            f"{owner}: the installed megatron-core's TransformerConfig has no "
            f"{', '.join(missing)}: {what} config fields came with megatron-core {since}; "
            f"install megatron-core>={since} to build {what}"
        )
