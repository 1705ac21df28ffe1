"""Tiny Gated DeltaNet hybrids (hidden 64, vocab 96) for the GDN layer and spec tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.transformer.megatron_models import VOCAB, gpt

GDN_FIELDS = dict(
    experimental_attention_variant="gated_delta_net",
    linear_attention_freq=4,  # layers 0-2 GDN, layer 3 full attention
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,  # K != V
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # grouped value heads (2 per key head)
)


def gdn_config(**overrides):
    from mcore_npu.transformer.gated_delta_net import GDNTransformerConfig

    fields = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
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
        **GDN_FIELDS,
    )
    fields.update(overrides)
    return GDNTransformerConfig(**fields)


def gdn_block(config, param_layout="te", **kwargs):
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    return get_gpt_decoder_block_npu_spec(
        config, kernel="reference", param_layout=param_layout, normalization=config.normalization,
        rms_norm_kernel="reference", swiglu_kernel="reference", grouped_matmul_kernel="reference",
        **kwargs,
    )  # fmt: skip


def gdn_gpt(config=None, param_layout="te", seed=0, **kwargs):
    config = config or gdn_config()
    return gpt(config, gdn_block(config, param_layout, **kwargs), seed=seed)


def gdn_layer(config=None, param_layout="te", seed=0):
    """One ``NPUGatedDeltaNet`` as the hybrid spec builds it (layer 1's self_attention)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    config = config or gdn_config()
    spec = gdn_block(config, param_layout).layer_specs[0].submodules.self_attention
    torch.manual_seed(seed)
    groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    return build_module(spec, config=config, layer_number=1, pg_collection=groups)


def tokens(b=2, s=24, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=gen)
    return ids, torch.arange(s).expand(b, s)


def loss_and_grads(model, ids, positions, **kwargs):
    """Mean token loss (labels = ids shifted) and every parameter's gradient, by name."""
    model.zero_grad(set_to_none=True)
    labels = torch.roll(ids, -1, dims=1)
    loss = model(ids, positions, None, labels=labels, **kwargs).float().mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads
