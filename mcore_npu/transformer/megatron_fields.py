"""The ``TransformerConfig`` fields megatron-core added after 0.15, by the first admitted minor
line that has them, so that a refusal of a field the installed Megatron lacks can name the
version that has it.

Whether a field exists is always read from the installed class (``dataclasses.fields``); this
table only words the message. It lists the fields of the 0.16.1, 0.17.1, 0.18.2 and 0.19.2 wheels
(``make test-compat`` installs them) that the previous one lacks; ``REMOVED_AFTER`` the 0.16.1
fields 0.17.1 lacks. ``tests/transformer/test_megatron_fields.py`` checks it against the installed
megatron-core.
"""

from __future__ import annotations

FIELDS_SINCE: dict[str, tuple[str, ...]] = {
    "0.16": (
        "attention_output_gate",
        "batch_invariant_mode",
        "dsa_indexer_head_dim",
        "dsa_indexer_loss_coeff",
        "dsa_indexer_n_heads",
        "dsa_indexer_topk",
        "dsa_indexer_use_sparse_loss",
        "ep_overlap_early_attn_memory_release",
        "experimental_attention_variant",
        "fine_grained_activation_offloading",
        "fp4_quantizer_factory",
        "fp8_quantizer_factory",
        "hybrid_context_parallel",
        "inference_fuse_tp_communication",
        "kitchen_attention_backend",
        "linear_attention_freq",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_value_head_dim",
        "log_max_attention_logit",
        "max_seqlen_per_dp_cp_rank",
        "min_offloaded_tensor_size",
        "moe_enable_routing_replay",
        "moe_flex_dispatcher_backend",
        "moe_hybridep_num_sms",
        "moe_latent_size",
        "moe_router_padding_for_quantization",
        "moe_shared_expert_gate",
        "mtp_standalone",
        "offload_modules",
        "qk_clip",
        "qk_clip_alpha",
        "qk_clip_threshold",
        "qk_l2_norm",
        "use_inference_optimized_layers",
        "use_kitchen_attention",
    ),
    "0.17": (
        "cpu_offloading_retain_pinned_cpu_buffers",
        "fused_residual_rmsnorm",
        "inference_disable_triton_nvls_kernels",
        "inference_grouped_gemm_backend",
        "inference_moe_disable_fused_quant_kernels",
        "moe_hybridep_num_blocks_permute",
        "moe_hybridep_num_blocks_unpermute",
        "moe_pad_experts_for_cuda_graph_inference",
        "moe_permute_fusion_into_hybridep",
        "moe_router_force_biased",
        "mtp_hybrid_override_pattern",
        "mtp_use_repeated_layer",
        "mup_attn_scale_power",
        "mup_base_head_dim",
        "mup_base_hidden_size",
        "mup_embedding_mult",
        "mup_output_mult",
        "mup_width_mult",
        "nccl_all_reduce_for_prefill",
        "use_mup",
    ),
    "0.18": (
        "cuda_graph_modules",
        "fine_grained_offloading_max_inflight_offloads",
        "fp8_output_proj",
        "high_priority_a2a_comm_stream",
        "inference_cuda_graph_scope",
        "inference_moe_token_dispatcher_type",
        "mlp_chunks_for_training",
        "moe_expert_rank_capacity_factor",
        "moe_hybridep_num_sms_preprocessing",
        "moe_mlp_glu_interleave_size",
        "moe_paged_stash",
        "moe_paged_stash_buffer_size_factor_cpu",
        "moe_paged_stash_buffer_size_factor_cuda",
        "moe_paged_stash_page_size",
        "moe_single_grouped_bias",
        "moe_single_grouped_weight",
        "overlap_dispatch_backward_with_experts_wgrad",
        "use_grouped_gemm_for_dense_mlp",
        "use_transformer_engine_op_fuser",
    ),
    "0.19": (
        "activation_offload_fraction",
        "delay_offload_until_cuda_graph",
        "delta_offload_bytes_across_pp_ranks",
        "dsa_indexer_k_norm_epsilon",
        "dsa_indexer_k_norm_fp32",
        "dsa_indexer_rope_interleaved",
        "dsa_indexer_rotate_activation",
        "dsa_indexer_scoring_relu",
        "dsa_indexer_skip_topk_offset",
        "dsa_indexer_topk_freq",
        "dsa_kernel_backend",
        "experimental_attention_variant_loss_scale_func",
        "expert_gtp_weight_remat_size",
        "expert_tensor_parallel_num_weight_shards",
        "flash_attention_version",
        "gtp_weight_remat_size",
        "mamba_training_ssm_states_dtype",
        "moe_flex_dispatcher_num_sms",
        "moe_grad_scale_func",
        "moe_hybridep_pad_uneven_dispatch_inputs",
        "moe_ncclep_static_shape",
        "moe_ncclep_zero_copy",
        "moe_router_quantile_balancing_ema",
        "moe_shared_expert_glu_interleave_size",
        "mtp_detach_heads",
        "mtp_grad_scale_func",
        "tensor_parallel_num_weight_shards",
        "use_grouped_gemm_for_shared_expert",
    ),
}
REMOVED_AFTER: dict[str, tuple[str, ...]] = {
    "0.16": ("async_tensor_model_parallel_allreduce", "moe_extended_tp",
             "moe_use_legacy_grouped_gemm"),
}  # fmt: skip


def version_with(field: str) -> str | None:
    """Which megatron-core has the ``TransformerConfig`` field ``field``, in words
    (``"megatron-core 0.16+"``, ``"megatron-core 0.15 (removed in 0.16)"``); None if unknown."""
    for since, names in FIELDS_SINCE.items():
        if field in names:
            return f"megatron-core {since}+"
    for last, names in REMOVED_AFTER.items():
        if field in names:
            major, minor = last.split(".")
            return f"megatron-core {last} (removed in {major}.{int(minor) + 1})"
    return None


def install_hint(field: str) -> str | None:
    """What to do about a field the installed megatron-core lacks, naming the version that has
    it (None if this table does not know the field)."""
    where = version_with(field)
    if where is None:
        return None
    return f"{where} has {field}: install that version, or remove the key"
