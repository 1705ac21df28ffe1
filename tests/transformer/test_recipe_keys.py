"""The recipe vocabulary (specs/recipe_keys.yaml) through the translator, key by key.

Every key of the table appears in ``CASES`` or ``REFUSALS`` below (the last test checks it), each
with the outcome the issue asks for written out by hand. Megatron kwargs that a plan produces are
handed to the real ``TransformerConfig`` (no TypeError may come out of it; none is caught here).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from mcore_npu.transformer.megatron_features import version_with
from mcore_npu.transformer.pipeline_layout import megatron_stage_layout
from mcore_npu.transformer.recipe_keys import (
    RecipeContext,
    load_table,
    render_table,
    translate,
)

BASE = RecipeContext(config_class=TransformerConfig, num_layers=4)
PP2 = RecipeContext(config_class=TransformerConfig, num_layers=4, pipeline_parallel_size=2)
PP4 = RecipeContext(config_class=TransformerConfig, num_layers=8, pipeline_parallel_size=4)
CP2 = RecipeContext(config_class=TransformerConfig, num_layers=4, context_parallel_size=2)
TP2 = RecipeContext(config_class=TransformerConfig, num_layers=4, tensor_parallel_size=2,
                    sequence_parallel=True)  # fmt: skip
MLA = RecipeContext(config_class=MLATransformerConfig, num_layers=4)
GDN = RecipeContext(config_class=TransformerConfig, num_layers=4, gated_delta_net=True)
GDN_CP2 = RecipeContext(config_class=TransformerConfig, num_layers=4, context_parallel_size=2,
                        gated_delta_net=True)  # fmt: skip
MLA_CP2 = RecipeContext(config_class=MLATransformerConfig, num_layers=4, context_parallel_size=2)
DSA = {"experimental_attention_variant": "dsa"}

# (overrides, context, megatron kwargs, spec keywords, optimizer fields, a log fragment or None)
CASES = [
    ({"use_flash_attn": True}, BASE, {}, {}, {}, "NPUFusionAttention"),
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
     BASE, {"recompute_granularity": "full", "recompute_method": "uniform",
            "recompute_num_layers": 1}, {}, {}, None),
    ({"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}, BASE,
     {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}, {}, {}, None),
    ({"attention_backend": "flash"}, BASE, {}, {}, {}, "NPUFusionAttention whatever it says"),
    ({"moe_permute_fusion": True}, BASE, {}, {"moe_permute_kernel": None}, {}, None),
    ({"moe_permute_fusion": False}, BASE, {}, {"moe_permute_kernel": "off"}, {}, None),
    ({"use_fused_moe_token_permute_and_unpermute": True}, BASE, {},
     {"moe_permute_kernel": None}, {}, None),
    ({"use_fused_moe_token_permute_and_unpermute": False}, BASE, {},
     {"moe_permute_kernel": "off"}, {}, None),
    ({"fused_permute_unpermute": "True"}, BASE, {}, {"moe_permute_kernel": None}, {}, None),
    ({"moe_token_dispatcher_type": "alltoall"}, BASE,
     {"moe_token_dispatcher_type": "alltoall"}, {}, {}, None),
    ({"apply_rope_fusion": True}, BASE, {}, {"rope_kernel": None}, {}, None),
    ({"apply_rope_fusion": False}, BASE, {}, {"rope_kernel": "off"}, {}, None),
    ({"use_fused_rotary_pos_emb": True}, BASE, {}, {"rope_kernel": None}, {}, None),
    ({"use_fused_rotary_pos_emb": False}, BASE, {}, {"rope_kernel": "off"}, {}, None),
    ({"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 3}, PP2,
     {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 3},
     {}, {}, None),
    ({"num_layers_in_first_pipeline_stage": 2, "num_layers_in_last_pipeline_stage": 2}, BASE,
     {}, {}, {}, "pipeline-parallel size 1"),
    ({"pipeline_num_transformer_layers": [[1], [3]]}, PP2,
     {"num_layers_in_first_pipeline_stage": 1}, {}, {}, "stage layout"),
    # as verl's Ascend recipes write it: the list and its own first / last counts together
    ({"pipeline_num_transformer_layers": [[1], [3]], "num_layers_in_first_pipeline_stage": 1,
      "num_layers_in_last_pipeline_stage": 3}, PP2,
     {"num_layers_in_first_pipeline_stage": 1}, {}, {}, "stage layout"),
    ({"pipeline_num_transformer_layers": "[[1],[2],[2],[3]]"}, PP4,
     {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 3},
     {}, {}, None),
    ({"moe_grouped_gemm": True, "moe_aux_loss_coeff": 0.001, "moe_z_loss_coeff": 0.001,
      "moe_router_dtype": "fp32", "moe_router_enable_expert_bias": False}, BASE,
     {"moe_grouped_gemm": True, "moe_aux_loss_coeff": 0.001, "moe_z_loss_coeff": 0.001,
      "moe_router_dtype": "fp32", "moe_router_enable_expert_bias": False}, {}, {}, None),
    ({"use_fused_rmsnorm": True, "use_fused_swiglu": True}, BASE, {},
     {"rms_norm_kernel": None, "swiglu_kernel": None}, {}, None),
    ({"use_fused_rmsnorm": False, "use_fused_swiglu": False}, BASE, {},
     {"rms_norm_kernel": "off", "swiglu_kernel": "off"}, {}, None),
    ({"use_naive_l2norm": False}, BASE, {}, {}, {}, "no effect: no gated-delta-net layers"),
    # Kimi-K2.5's recipe sets it on an MLA model: accepted, no effect, one line
    ({"use_naive_l2norm": True}, MLA, {}, {}, {}, "no effect: no gated-delta-net layers"),
    ({"use_naive_l2norm": True}, GDN, {}, {"gdn_naive_l2norm": True}, {}, None),
    ({"use_naive_l2norm": False}, GDN, {}, {"gdn_naive_l2norm": False}, {}, None),
    ({"context_parallel_algo": "kvallgather_cp_algo"}, GDN_CP2,
     {"cp_comm_type": "all_gather"}, {}, {}, "the full-attention layers; the gated-delta-net"),
    ({"experimental_attention_variant": "gated_delta_net"}, GDN,
     {"experimental_attention_variant": "gated_delta_net"}, {}, {}, None),
    ({"context_parallel_size": 2}, CP2, {}, {}, {}, "agrees with verl"),
    ({"sequence_parallel": True}, TP2, {}, {}, {}, "agrees with verl"),
    ({"sequence_parallel": True}, BASE, {}, {}, {}, "tensor-parallel size 1"),
    ({"context_parallel_algo": "megatron_cp_algo"}, CP2, {"cp_comm_type": "p2p"}, {}, {}, None),
    ({"context_parallel_algo": "kvallgather_cp_algo"}, CP2,
     {"cp_comm_type": "all_gather"}, {}, {}, None),
    ({"context_parallel_algo": "ulysses_cp_algo"}, CP2, {"cp_comm_type": "a2a"}, {}, {}, None),
    ({"use_distributed_optimizer": True}, BASE, {}, {}, {"use_distributed_optimizer": True},
     None),
    ({"use_distributed_optimizer": False}, BASE, {}, {}, {"use_distributed_optimizer": False},
     None),
    ({"gradient_accumulation_fusion": True}, BASE, {"gradient_accumulation_fusion": False},
     {}, {}, "once per linear layer per micro-batch"),
    ({"gradient_accumulation_fusion": False}, BASE, {"gradient_accumulation_fusion": False},
     {}, {}, None),
    ({"normalization": "RMSNorm"}, BASE, {"normalization": "RMSNorm"}, {}, {}, None),
    ({"position_embedding_type": "rope", "swiglu": True}, BASE, {}, {}, {}, "Hugging Face"),
    ({"multi_latent_attention": False}, BASE, {"multi_latent_attention": False}, {}, {}, None),
    ({"multi_head_latent_attention": True}, MLA, {"multi_latent_attention": True}, {}, {},
     "multi_latent_attention"),
    ({"use_ascend_gdn": False, "use_triton_gdn": False}, BASE, {}, {}, {}, "gated-delta-net"),
    ({"use_ascend_gdn": True, "use_triton_gdn": True}, BASE, {}, {}, {},
     "no effect: no gated-delta-net layers"),
    # the recipes' USE_MINDSPEED_BRIDGE=True lines, on a model with GDN layers
    ({"use_triton_gdn": False, "use_ascend_gdn": True}, GDN, {}, {}, {}, "fla_npu"),
    ({"use_triton_gdn": True, "use_ascend_gdn": False}, GDN, {}, {}, {}, "triton-ascend"),
    ({"use_flash_attn_npu_batch_invariant": False, "use_batch_invariant_ops": False}, BASE,
     {}, {}, {}, "batch-invariant"),
    ({"batch_invariant_mode": False}, BASE, {"batch_invariant_mode": False}, {}, {}, None),
    # the true-on-policy recipes: the three keys together, one switch of the NPU spec
    ({"use_flash_attn_npu_batch_invariant": True, "batch_invariant_mode": True,
      "use_batch_invariant_ops": True}, BASE, {}, {"batch_invariant": True}, {},
     "batch_invariant=True"),
    ({"batch_invariant_mode": True}, BASE, {}, {"batch_invariant": True}, {},
     "batch_invariant_mode=true: NPU spec batch_invariant=True"),
    ({"rope_scaling_type": "yarn", "yarn_scaling_factor": 4.0, "rope_scaling_mscale": 1.0,
      "rope_scaling_mscale_all_dim": 1.0}, MLA,
     {"rope_type": "yarn", "rotary_scaling_factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0},
     {}, {}, "rotary_scaling_factor"),
    ({"seq_length": 4096}, BASE, {}, {}, {}, "sequence length"),
    ({"swap_optimizer": False}, BASE, {}, {}, {}, "swapping off"),
    ({"use_ascend_mc2": False}, BASE, {}, {}, {}, "MC2"),
    ({"attention_softmax_in_fp32": True}, BASE, {"attention_softmax_in_fp32": True}, {}, {}, None),
    ({"masked_softmax_fusion": False}, BASE, {}, {}, {}, "no separate masked softmax"),
    ({"bias_dropout_fusion": False}, BASE, {"bias_dropout_fusion": False}, {}, {}, None),
    ({"reset_position_ids": False}, BASE, {}, {}, {}, "position ids"),
    ({"fp8": False}, BASE, {}, {}, {}, "no fp8"),
    ({"use_mamba_mem_eff_path": False}, BASE, {}, {}, {}, "Mamba"),
    ({"ckpt_acceleration": True}, BASE, {}, {}, {}, "dist_checkpointing"),
    ({"hidden_dropout": 0.0}, BASE, {"hidden_dropout": 0.0}, {}, {}, None),  # a plain field
    # DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): Megatron's fields, the three fused
    # switches onto the DSA operators' kernels, the absorbed form accepted in one line
    (DSA, MLA, DSA, {}, {}, None),
    ({**DSA, "dsa_indexer_n_heads": 4, "dsa_indexer_head_dim": 32, "dsa_indexer_topk": 8,
      "dsa_indexer_loss_coeff": 0.01, "dsa_indexer_use_sparse_loss": True}, MLA,
     {**DSA, "dsa_indexer_n_heads": 4, "dsa_indexer_head_dim": 32, "dsa_indexer_topk": 8,
      "dsa_indexer_loss_coeff": 0.01, "dsa_indexer_use_sparse_loss": True}, {}, {}, None),
    ({"use_dsa_absorb": True}, MLA, {}, {}, {}, "use_dsa_absorb=true: the NPU DSA layer runs MLA "
                                                "in the absorbed form"),
    ({"use_fused_lightning_indexer": True, "use_fused_sparse_flash_attention": True,
      "use_fused_lightning_indexer_kl_loss": True}, MLA, {},
     {"lightning_indexer_kernel": "auto", "sparse_attention_kernel": "auto",
      "indexer_loss_kernel": "auto"}, {}, "use_fused_lightning_indexer=true: NPU spec "
                                          "lightning_indexer_kernel='auto'"),
    ({"use_fused_lightning_indexer": False, "use_fused_sparse_flash_attention": "False",
      "use_fused_lightning_indexer_kl_loss": False}, MLA, {},
     {"lightning_indexer_kernel": "reference", "sparse_attention_kernel": "reference",
      "indexer_loss_kernel": "reference"}, {}, "sparse_attention_kernel='reference'"),
    # DSA's one CP algorithm, accepted with a line that says so (CP 1: Megatron 0.16.1's config
    # asserts context_parallel_size == 1 with dsa)
    ({**DSA, "context_parallel_algo": "kvallgather_cp_algo"}, MLA,
     {**DSA, "cp_comm_type": "all_gather"}, {}, {},
     "context_parallel_algo=kvallgather_cp_algo: cp_comm_type='all_gather' (DSA layers run "
     "context parallelism by K/V all-gather only)"),
]  # fmt: skip

# (overrides, context, fragments the one-line message must contain)
REFUSALS = [
    ({"use_flash_attn": False}, BASE, ["use_flash_attn=false", "npu_fusion_attention"]),
    ({"moe_token_dispatcher_type": "flex"}, BASE, ["flex", "DeepEP", "use alltoall"]),
    ({"num_layers_in_first_pipeline_stage": 1}, PP4, ["number of layers at middle stage: 7",
                                                      "divisible"]),
    ({"pipeline_num_transformer_layers": [[1], [2]]}, PP2, ["adds up to 3 layers",
                                                            "num_layers is 4"]),
    ({"pipeline_num_transformer_layers": [[4]]}, PP2, ["has 1 stages",
                                                       "pipeline parallel size is 2"]),
    ({"pipeline_num_transformer_layers": [[1], [3]], "num_layers_in_first_pipeline_stage": 2},
     PP2, ["num_layers_in_first_pipeline_stage=2", "disagrees with", "make it 1"]),
    ({"context_parallel_size": 8}, CP2, ["context_parallel_size=8",
                                         "megatron.context_parallel_size is 2"]),
    ({"sequence_parallel": False}, TP2, ["sequence_parallel=false",
                                         "megatron.sequence_parallel is true"]),
    ({"context_parallel_algo": "hybrid_cp_algo"}, CP2,
     ["hybrid_cp_algo", "megatron_cp_algo", "kvallgather_cp_algo", "ulysses_cp_algo"]),
    ({"context_parallel_algo": "hybrid_adaptive_cp_algo"}, CP2, ["hybrid_adaptive_cp_algo",
                                                                "ulysses_cp_algo (a2a)"]),
    ({"cp_comm_type": "a2a+p2p"}, CP2, ["cp_comm_type=a2a+p2p", "hierarchical", "'a2a'"]),
    ({"cp_comm_type": ["p2p", "ring"]}, CP2, ["cp_comm_type=ring", "p2p, all_gather, a2a"]),
    ({"hierarchical_context_parallel_sizes": [2, 1]}, CP2,
     ["hierarchical_context_parallel_sizes=[2, 1]", "not built"]),
    ({"context_parallel_algo": "megatron_cp_algo", "attention_dropout": 0.1}, CP2,
     ["attention_dropout=0.1", "dropout mask", "'all_gather'"]),
    ({"position_embedding_type": "learned_absolute"}, BASE, ["learned_absolute",
                                                            "Hugging Face"]),
    ({"swiglu": False}, BASE, ["swiglu=false", "Hugging Face"]),
    ({"use_flash_attn_npu_batch_invariant": True, "use_batch_invariant_ops": False}, BASE,
     ["use_batch_invariant_ops=false", "turned batch_invariant on", "one switch"]),
    ({"batch_invariant_mode": "yes"}, BASE, ["batch_invariant_mode=yes", "use true or false"]),
    ({"use_batch_invariant_ops": True}, CP2, ["use_batch_invariant_ops=true",
                                              "batch-invariant mode does not support "
                                              "context_parallel_size=2"]),
    ({"batch_invariant_mode": True, "attention_dropout": 0.1}, BASE,
     ["batch_invariant_mode=true", "attention_dropout=0.1: use 0.0"]),
    ({"batch_invariant_mode": True, "window_size": [128, 0]}, BASE,
     ["sliding window"]),
    ({"rope_scaling_type": "yarn"}, BASE, ["rope_type", "TransformerConfig", "config.json"]),
    ({"rope_scaling_type": "llama3"}, MLA, ["rope_scaling_type=llama3", "rope or yarn"]),
    ({"yarn_scaling_factor": 4.0}, BASE, ["rotary_scaling_factor", "config.json"]),
    ({"rope_scaling_mscale": 1.0}, BASE, ["mscale", "config.json"]),
    ({"rope_scaling_mscale_all_dim": 1.0}, BASE, ["mscale_all_dim", "config.json"]),
    ({"use_ascend_mc2": True}, BASE, ["use_ascend_mc2=true", "MC2"]),
    ({"reset_position_ids": True}, BASE, ["reset_position_ids=true", "use_remove_padding=True"]),
    ({"fp8": "hybrid"}, BASE, ["fp8=hybrid", "Transformer Engine"]),
    ({"use_mamba_mem_eff_path": True}, BASE, ["use_mamba_mem_eff_path=true", "Mamba"]),
    ({"experimental_attention_variant": "mamba"}, BASE,
     ["experimental_attention_variant=mamba", "gated_delta_net", "dsa", "remove the key"]),
    ({"experimental_attention_variant": "gated_delta_net"}, BASE,
     ["experimental_attention_variant=gated_delta_net", "no linear-attention layers"]),
    ({"use_dsa_absorb": False}, MLA, ["use_dsa_absorb=false", "absorbed form the NPU kernel "
                                      "takes", "set it true or remove it"]),
    ({"use_fused_lightning_indexer": "fused"}, MLA, ["use_fused_lightning_indexer=fused",
                                                     "accepts only true, false"]),
    # with DSA layers every CP algorithm but all-gather is refused, in either key order, at any
    # CP size, naming the key that chose it
    ({"context_parallel_algo": "megatron_cp_algo", **DSA}, MLA_CP2,
     ["context_parallel_algo=megatron_cp_algo", "cp_comm_type='p2p'", "K/V all-gather only",
      "use kvallgather_cp_algo"]),
    ({**DSA, "context_parallel_algo": "ulysses_cp_algo"}, MLA,
     ["context_parallel_algo=ulysses_cp_algo", "cp_comm_type='a2a'", "K/V all-gather only"]),
    ({**DSA, "cp_comm_type": ["all_gather", "p2p"]}, MLA_CP2,
     ["cp_comm_type=['all_gather', 'p2p']", "cp_comm_type='p2p'", "K/V all-gather only"]),
    ({"moe_permute_fusion": True, "use_fused_moe_token_permute_and_unpermute": False}, BASE,
     ["use_fused_moe_token_permute_and_unpermute=false", "moe_permute_kernel"]),
    ({"use_fused_rmsnrom": True}, BASE, ["use_fused_rmsnrom", "did you mean 'use_fused_rmsnorm'"]),
    ({"moe_permute_fusoin": True}, BASE, ["did you mean 'moe_permute_fusion'"]),
]  # fmt: skip


def _config(megatron: dict, context: RecipeContext):
    """The real Megatron config built from a plan's kwargs (a small model around them)."""
    kwargs = dict(num_layers=context.num_layers, hidden_size=64, num_attention_heads=4,
                  pipeline_model_parallel_size=context.pipeline_parallel_size,
                  context_parallel_size=context.context_parallel_size)  # fmt: skip
    if context.pipeline_parallel_size > 1:
        kwargs["pipeline_dtype"] = torch.float32
    if megatron.get("experimental_attention_variant") == "gated_delta_net":
        kwargs.update(linear_attention_freq=4, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=16)  # fmt: skip
    if context.config_class is MLATransformerConfig:
        kwargs.update(q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
                      v_head_dim=16)  # fmt: skip
    return context.config_class(**kwargs, **megatron)


@pytest.mark.parametrize(("overrides", "context", "megatron", "spec", "optimizer", "log"), CASES)
def test_translation(overrides, context, megatron, spec, optimizer, log):
    before = dict(overrides)
    fields = {f.name for f in dataclasses.fields(context.config_class)}
    missing = sorted(set(megatron) - fields)
    if missing:  # a field the installed Megatron lacks (0.15: batch_invariant_mode)
        with pytest.raises(ValueError) as info:
            translate(overrides, context)
        message = str(info.value)  # one line naming the version that has the field
        assert "\n" not in message and f"{version_with(missing[0])} has {missing[0]}" in message
        assert overrides == before
        return
    plan = translate(overrides, context)
    assert plan.megatron == megatron
    assert plan.spec == spec
    assert plan.optimizer == optimizer
    if log is not None:
        assert any(log in line for line in plan.log), plan.log
    assert overrides == before  # the recipe is not changed
    _config(plan.megatron, context)  # Megatron accepts what the plan hands it


@pytest.mark.parametrize(("overrides", "context", "fragments"), REFUSALS)
def test_refusal_is_one_line_naming_key_value_and_what_to_do(overrides, context, fragments):
    key = next(iter(overrides))
    if key == "num_layers_in_first_pipeline_stage":  # Megatron's own check, on the plan
        plan = translate(overrides, context)
        with pytest.raises(ValueError) as info:
            _config(plan.megatron, context)
    else:
        with pytest.raises(ValueError) as info:
            translate(overrides, context)
        message = str(info.value)
        assert "\n" not in message
        starts = [f"override_transformer_config.{name}=" for name in overrides]
        assert any(message.startswith(start) for start in starts), message
        assert "refused" in message
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_swap_optimizer_maps_to_the_cpu_optimizer_offload_in_one_log_line():
    plan = translate({"swap_optimizer": True}, BASE)
    assert plan.megatron == {} and plan.optimizer == {}
    assert plan.optimizer_keys == {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0,
                                   "overlap_cpu_optimizer_d2h_h2d": True}  # fmt: skip
    lines = [line for line in plan.log if "swap_optimizer" in line]
    assert len(lines) == 1 and "optimizer_cpu_offload=true" in lines[0], plan.log


def test_every_key_of_the_table_is_exercised():
    used = {key for case in CASES for key in case[0]}
    used |= {key for case in REFUSALS for key in case[0]}
    assert set(load_table()) - used == set()


def test_the_issues_census_keys_are_in_the_table():
    """The census of ascend_recipes.md and the MindSpeed / verl guide keys, named by hand."""
    census = re.findall(
        r"\w+",
        """use_flash_attn recompute_granularity recompute_method recompute_num_layers
    attention_backend moe_permute_fusion moe_token_dispatcher_type apply_rope_fusion
    num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage moe_grouped_gemm
    moe_aux_loss_coeff moe_z_loss_coeff moe_router_dtype use_fused_rmsnorm use_naive_l2norm
    context_parallel_size normalization use_fused_rotary_pos_emb use_fused_swiglu
    sequence_parallel context_parallel_algo use_distributed_optimizer
    gradient_accumulation_fusion position_embedding_type swiglu multi_latent_attention
    multi_head_latent_attention use_ascend_gdn use_triton_gdn use_flash_attn_npu_batch_invariant
    batch_invariant_mode use_batch_invariant_ops pipeline_num_transformer_layers rope_scaling_type
    yarn_scaling_factor rope_scaling_mscale rope_scaling_mscale_all_dim seq_length swap_optimizer
    use_ascend_mc2 moe_router_enable_expert_bias attention_softmax_in_fp32 masked_softmax_fusion
    bias_dropout_fusion reset_position_ids fp8 use_mamba_mem_eff_path
    experimental_attention_variant use_dsa_absorb use_fused_lightning_indexer
    use_fused_sparse_flash_attention use_fused_moe_token_permute_and_unpermute ckpt_acceleration
    fused_permute_unpermute use_fused_lightning_indexer_kl_loss dsa_indexer_use_sparse_loss
    dsa_indexer_loss_coeff""",
    )
    assert set(census) - set(load_table()) == set()


def test_unknown_value_of_a_listed_key_is_refused_naming_the_accepted_ones():
    table = {"k": {"values": {True: {"do": "ignore", "why": "w"}}}}
    with pytest.raises(ValueError, match=r"k=maybe: refused: the plugin accepts only true"):
        translate({"k": "maybe"}, BASE, table=table)


def test_stage_list_from_hydra_is_read_like_a_list():
    from omegaconf import OmegaConf

    overrides = OmegaConf.create({"pipeline_num_transformer_layers": [[1], [3]]})
    plan = translate(overrides, PP2)
    assert plan.megatron == {"num_layers_in_first_pipeline_stage": 1}


def test_stage_layout_with_uneven_middle_stages_is_megatrons_layout_string():
    kwargs = megatron_stage_layout([1, 3, 2, 2], num_layers=8, pipeline_size=4)
    assert kwargs == {"pipeline_model_parallel_layout": "Et|ttt|tt|ttL"}
    _config(kwargs, PP4)


def test_stage_layout_with_virtual_chunks_orders_them_virtual_stage_first():
    kwargs = megatron_stage_layout([[1, 1], [2, 4]], num_layers=8, pipeline_size=2, vpp_size=2)
    assert kwargs == {"pipeline_model_parallel_layout": "Et|tt|t|ttttL"}


def test_docs_table_equals_the_yaml_rendering():
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "mindspeed.md").read_text()
    section = page[page.index("\n## The key table") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section[1:] else section
    table = render_table()
    assert table in section, (
        "docs/mindspeed.md is out of date: python -m mcore_npu.transformer.recipe_keys"
    )
    rows = [line for line in section.splitlines() if re.match(r"\| `", line)]
    assert len(rows) == table.count("\n") - 2  # no extra rows beside the rendering


def test_the_perf_tuning_pages_keys_translate_except_mc2():
    """verl's Ascend perf-tuning page (docs/ascend_tutorial/dev_guide/performance/
    perf_tuning_on_ascend.rst) names these switches together; MC2 is the one the plugin lacks."""
    page = {"use_flash_attn": True, "apply_rope_fusion": True, "use_fused_rotary_pos_emb": True,
            "use_fused_rmsnorm": True, "moe_grouped_gemm": True, "use_fused_swiglu": True,
            "fused_permute_unpermute": True, "use_distributed_optimizer": True}  # fmt: skip
    plan = translate(page, BASE)
    assert plan.megatron == {"moe_grouped_gemm": True}
    assert plan.spec == {"rope_kernel": None, "rms_norm_kernel": None, "swiglu_kernel": None,
                         "moe_permute_kernel": None}  # fmt: skip
    with pytest.raises(ValueError, match=r"use_ascend_mc2=true: refused"):
        translate({**page, "use_ascend_mc2": True}, BASE)


def test_use_naive_l2norm_is_one_log_line_on_every_model():
    """Honoured on a model with gated-delta-net layers, no effect on any other (Kimi-K2.5's MLA
    recipe): one line each, and never a Megatron kwarg or a spec keyword."""
    for context, spec in ((GDN, {"gdn_naive_l2norm": True}), (MLA, {}), (BASE, {})):
        plan = translate({"use_naive_l2norm": True}, context)
        lines = [line for line in plan.log if "use_naive_l2norm" in line]
        assert len(lines) == 1, plan.log
        assert ("no effect" in lines[0]) == (not spec), lines
        assert plan.megatron == {} and plan.spec == spec


def test_the_gdn_outcome_is_described_for_both_kinds_of_model():
    table = render_table()
    row = next(
        line for line in table.splitlines() if line.startswith("| `use_naive_l2norm` | `true`")
    )
    assert "models with gated-delta-net layers: NPU spec `gdn_naive_l2norm=True`;" in row
    assert "other models: no effect" in row


GDN_RECIPES = Path(__file__).parents[1] / "integrations" / "gdn_recipes.yaml"


@pytest.mark.parametrize(
    "recipe", yaml.safe_load(GDN_RECIPES.read_text())["recipes"], ids=lambda r: r["name"]
)
def test_the_qwen3_5_recipes_translate_at_their_own_parallel_sizes(recipe):
    """The five Qwen3.5 recipes' key sets (three distinct ones), verbatim, on a model with
    gated-delta-net layers at the recipe's TP / PP / CP: every key accepted, the MoE and recompute
    keys to Megatron, the fused switches to the spec, kvallgather to the full-attention layers."""
    sizes, keys = recipe["parallel"], recipe["keys"]
    context = RecipeContext(
        config_class=TransformerConfig, num_layers=48, tensor_parallel_size=sizes["tensor"],
        pipeline_parallel_size=sizes["pipeline"], context_parallel_size=sizes["context"],
        sequence_parallel=sizes["tensor"] > 1, gated_delta_net=True,
    )  # fmt: skip
    plan = translate(keys, context)
    passed = ("recompute_method", "recompute_granularity", "recompute_num_layers",
              "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_grouped_gemm",
              "moe_token_dispatcher_type", "moe_router_dtype")  # fmt: skip
    want = {key: keys[key] for key in passed if key in keys}
    if "context_parallel_algo" in keys:
        want["cp_comm_type"] = "all_gather"
        cp_line = next(line for line in plan.log if "context_parallel_algo" in line)
        assert "the full-attention layers" in cp_line, cp_line
    assert plan.megatron == want
    fused = {"use_fused_rmsnorm": "rms_norm_kernel", "use_fused_swiglu": "swiglu_kernel",
             "moe_permute_fusion": "moe_permute_kernel"}  # fmt: skip
    assert plan.spec == {**{fused[key]: None for key in keys if key in fused},
                         "gdn_naive_l2norm": True}  # fmt: skip


CENSUS = Path(__file__).parents[1] / "integrations" / "recipe_settings.yaml"
TC = "megatron.override_transformer_config."


def _census_transformer_keys(row: str) -> dict:
    """A census row's actor ``override_transformer_config`` keys, values as YAML reads them."""
    rows = yaml.safe_load(CENSUS.read_text())["rows"]
    keys = next(r for r in rows if r["row"] == row)["transformer_keys"]
    pairs = (key.lstrip("+").split("=", 1) for key in keys if "actor." + TC in key)
    return {path.rsplit(".", 1)[-1]: yaml.safe_load(value.strip("'\"")) for path, value in pairs}


DSA_SPEC = {"rms_norm_kernel": None, "swiglu_kernel": None, "lightning_indexer_kernel": "auto",
            "sparse_attention_kernel": "auto", "indexer_loss_kernel": "auto"}  # fmt: skip


def test_the_glm5_recipe_translates_at_its_own_parallel_sizes():
    """GLM-5's recipe (census row 25), verbatim, at TP2 PP8 CP4 on an MLA model: every key
    accepted; the DSA fields and the all-gather CP to Megatron, the fused switches to the NPU
    spec's DSA kernels, use_dsa_absorb in one line."""
    keys = _census_transformer_keys("25")
    context = RecipeContext(config_class=MLATransformerConfig, num_layers=78,
                            tensor_parallel_size=2, pipeline_parallel_size=8,
                            context_parallel_size=4, sequence_parallel=True)  # fmt: skip
    plan = translate(keys, context)
    assert keys["context_parallel_size"] == 4 and keys["dsa_indexer_loss_coeff"] == 0
    dsa = {"experimental_attention_variant": "dsa", "dsa_indexer_use_sparse_loss": True,
           "dsa_indexer_loss_coeff": 0, "cp_comm_type": "all_gather"}  # fmt: skip
    assert dsa.items() <= plan.megatron.items(), plan.megatron
    assert plan.spec == DSA_SPEC
    lines = [line for line in plan.log if "use_dsa_absorb=true" in line]
    assert len(lines) == 1 and "absorbed form" in lines[0], plan.log


def test_the_deepseek_v3_2_recipe_keys_translate_at_its_own_parallel_sizes():
    """The DeepSeek-V3.2-Exp Ascend script (verl main_ppo, DeepSeek-V3.2-Exp-bf16, TP8 PP16 EP16
    CP1) sets GLM-5's DSA keys with an indexer loss of 0.001: all accepted by the translator. (The
    layer trains the indexer at TP8 with the reference KL loss: the fused one sums one rank's
    heads, so ``auto`` falls back there; docs/dsa.md.)"""
    keys = {"experimental_attention_variant": "dsa", "use_dsa_absorb": True,
            "dsa_indexer_use_sparse_loss": True, "dsa_indexer_loss_coeff": 0.001,
            "use_fused_lightning_indexer": True, "use_fused_sparse_flash_attention": True,
            "use_fused_lightning_indexer_kl_loss": True, "moe_router_enable_expert_bias": True,
            "context_parallel_size": 1, "context_parallel_algo": "kvallgather_cp_algo",
            "reset_position_ids": False, "use_ascend_mc2": False, "use_fused_rmsnorm": True,
            "use_fused_swiglu": True}  # fmt: skip
    context = RecipeContext(config_class=MLATransformerConfig, num_layers=61,
                            tensor_parallel_size=8, pipeline_parallel_size=16,
                            sequence_parallel=True)  # fmt: skip
    plan = translate(keys, context)
    assert plan.megatron == {"experimental_attention_variant": "dsa", "cp_comm_type": "all_gather",
                             "dsa_indexer_use_sparse_loss": True, "dsa_indexer_loss_coeff": 0.001,
                             "moe_router_enable_expert_bias": True}  # fmt: skip
    assert plan.spec == DSA_SPEC
