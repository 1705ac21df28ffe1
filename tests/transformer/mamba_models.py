"""Tiny Mamba2 layers (hidden 32: 4 heads of 8, 2 groups, state 8) for the mixer tests."""

from __future__ import annotations

import torch

from tests.transformer.megatron_models import tiny_config

MAMBA_FIELDS = dict(mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, mamba_num_heads=4)


def mamba_config(**overrides):
    """``megatron_models.tiny_config`` at hidden 32 with the Mamba sizes (plain MLP, no qk-norm)."""
    fields = dict(
        num_layers=4,
        hidden_size=32,
        num_query_groups=None,
        ffn_hidden_size=64,
        gated_linear_unit=False,
        qk_layernorm=False,
        **MAMBA_FIELDS,
    )
    return tiny_config(**{**fields, **overrides})


def mamba_mixer(config, seed=0, chunk_size=4, **kwargs):
    """One ``NPUMambaMixer`` with the TE-layout ``in_proj`` (its input norm fused in), chunk 4 so
    that every test sequence spans several chunks."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from mcore_npu.transformer.mamba import NPUMambaMixer, NPUMambaMixerSubmodules
    from mcore_npu.transformer.norm_linear import NormColumnParallelLinear

    torch.manual_seed(seed)
    groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    submodules = NPUMambaMixerSubmodules(
        in_proj=NormColumnParallelLinear, out_proj=RowParallelLinear
    )
    return NPUMambaMixer(
        config,
        submodules,
        d_model=config.hidden_size,
        chunk_size=chunk_size,
        layer_number=1,
        pg_collection=groups,
        kernel="reference",
        **kwargs,
    )


MOE_FIELDS = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                  moe_router_load_balancing_type="none", moe_token_dispatcher_type="alltoall")  # fmt: skip


def hybrid_config(**overrides):
    """A config for the hybrid patterns here: Mamba, attention, MLP and MoE layers."""
    return mamba_config(is_hybrid_model=True, num_query_groups=2, **{**MOE_FIELDS, **overrides})


def hybrid_model(pattern: str, config=None, seed=0, vocab=64, **spec_kwargs):
    """Megatron's own hybrid model class (``HybridModel`` 0.18+, ``MambaModel`` before) built from
    ``get_hybrid_stack_npu_spec``; the pattern's length is the config's ``num_layers``."""
    from mcore_npu.transformer.mamba.spec import get_hybrid_stack_npu_spec
    from mcore_npu.transformer.mamba.stack import hybrid_model_class

    config = config or hybrid_config(num_layers=len(pattern))
    spec = get_hybrid_stack_npu_spec(kernel="reference", **spec_kwargs)
    torch.manual_seed(seed)
    model_class, spec_key, pattern_key = hybrid_model_class()
    return model_class(
        config,
        **{spec_key: spec, pattern_key: pattern},
        vocab_size=vocab,
        max_sequence_length=64,
        position_embedding_type="rope",
    )
