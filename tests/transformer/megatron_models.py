"""Tiny Megatron-Core GPT models for the spec and attention tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 96


def tiny_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,  # GQA
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        qk_layernorm=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def gpt(config, spec, seed: int = 0):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(
        config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=64,
        position_embedding_type="rope",
    )


def local_spec(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(
        normalization=config.normalization, qk_layernorm=config.qk_layernorm
    )


def npu_spec(config, kernel="reference", param_layout="local"):
    """The NPU spec; in the local layout by default, so its names are the local spec's (the TE
    layout against the local one: tests/transformer/test_param_layout.py). ``kernel`` is the
    attention's; the other fused operators run their reference
    (tests/transformer/test_fused_contract.py checks their torch_npu calls)."""
    from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec

    return get_gpt_layer_npu_spec(
        normalization=config.normalization, qk_layernorm=config.qk_layernorm, kernel=kernel,
        param_layout=param_layout, rms_norm_kernel="reference", swiglu_kernel="reference",
        grouped_matmul_kernel="reference",
    )  # fmt: skip


def twin_models(config):
    """A local-spec and an NPU-spec model (local layout) with the same weights."""
    local = gpt(config, local_spec(config))
    npu = gpt(config, npu_spec(config))
    npu.load_state_dict(local.state_dict(), strict=True)
    return local, npu


def batch(b=2, s=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=gen)
    return ids, torch.arange(s).expand(b, s)
