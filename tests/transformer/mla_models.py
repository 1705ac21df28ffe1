"""Tiny multi-latent-attention GPT models: the NPU spec's and Megatron's own as an oracle.

Megatron-Core 0.16.1 cannot build its ``MLASelfAttention`` without Transformer Engine (its
module's ``HAVE_TE`` is true while ``TELinear`` is a ``MagicMock``). The oracle builds it anyway
by fixing that module flag *for the construction only* (``megatron_oracle``: ``HAVE_TE = False``
while the model is built, restored after), from Megatron's own local MLA spec (its local linear
layers and norms). Its core attention is :class:`DefinitionAttention`, written here from the
definition, because Megatron's local ``DotProductAttention`` rejects MLA's ``k_channels``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

VOCAB = 96
PACKED = (5, 8, 3)  # thd: three sequences, 16 tokens


def mla_config(q_lora_rank=32, config_class=None, **overrides):
    """DeepSeek-V3's shape, tiny: D = 16 + 8 = 24 for q/k, Dv = 12, yarn RoPE."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    fields = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        q_lora_rank=q_lora_rank, kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=12, normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, bias_activation_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, rope_type="yarn",
        rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
        original_max_position_embeddings=8,
    )  # fmt: skip
    fields.update(overrides)
    return (config_class or MLATransformerConfig)(**fields)


def dsa_config(topk, coeff=0.0, sparse_loss=True, **overrides):
    """:func:`mla_config` with DeepSeek Sparse Attention: 8 indexer heads of 16, ``topk`` keys."""
    from mcore_npu.transformer.dsa import DSATransformerConfig

    return mla_config(
        config_class=DSATransformerConfig, experimental_attention_variant="dsa",
        dsa_indexer_n_heads=8, dsa_indexer_head_dim=16, dsa_indexer_topk=topk,
        dsa_indexer_loss_coeff=coeff, dsa_indexer_use_sparse_loss=sparse_loss, **overrides,
    )  # fmt: skip


def gpt(config, spec, seed=0, **kwargs):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=64, position_embedding_type="rope", **kwargs)  # fmt: skip


def npu_block(config, param_layout="local", **kwargs):
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    kwargs = {"kernel": "reference", "rms_norm_kernel": "reference",
              "swiglu_kernel": "reference", **kwargs}  # fmt: skip
    return get_gpt_decoder_block_npu_spec(config, param_layout=param_layout,
                                          normalization=config.normalization, **kwargs)  # fmt: skip


class DefinitionAttention(torch.nn.Module):
    """Causal ``softmax(scale * q k^T) v`` head by head, by definition (thd: per sequence).

    sbhd q/k ``[s, b, n, D]``, v ``[s, b, n, Dv]`` -> ``[s, b, n*Dv]``; thd ``[t, n, D]`` ->
    ``[t, n*Dv]``. Takes the keywords Megatron's MLA passes (``softmax_scale``, ``k_channels``...).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 softmax_scale=None, **_):  # fmt: skip
        super().__init__()
        self.scale = softmax_scale

    def forward(self, q, k, v, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_):  # fmt: skip
        if packed_seq_params is None:
            return _causal(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), self.scale).permute(
                2, 0, 1, 3).flatten(2)  # fmt: skip
        cu = packed_seq_params.cu_seqlens_q.tolist()
        outs = [
            _causal(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), self.scale)[0]
            for a, b in zip(cu, cu[1:])
        ]
        return torch.cat([o.transpose(0, 1) for o in outs]).flatten(1)


def _causal(q, k, v, scale):
    """q/k ``[b, n, s, D]``, v ``[b, n, s, Dv]`` -> ``[b, n, s, Dv]``."""
    scores = (q @ k.transpose(-1, -2)) * scale
    s = q.shape[-2]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@contextlib.contextmanager
def megatron_mla_without_te():
    """Megatron's multi_latent_attention module with ``HAVE_TE = False`` (this block only)."""
    from megatron.core.transformer import multi_latent_attention as module

    saved = module.HAVE_TE
    module.HAVE_TE = False
    try:
        yield
    finally:
        module.HAVE_TE = saved


def megatron_oracle(config, seed=0):
    """Megatron's own MLA GPT (its local block spec: dense and MoE layers as ``config`` says,
    its MLASelfAttention), DefinitionAttention inside."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization=config.normalization)  # fmt: skip
    from megatron.core.transformer.identity_op import IdentityOp

    for layer in block.layer_specs:
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = DefinitionAttention
        if config.q_lora_rank is None:  # no q norm is built without q LoRA; 0.19+ refuses one
            attention.q_layernorm = IdentityOp
            layer.submodules.self_attention.module = _attention_without_q_lora()
    with megatron_mla_without_te():
        return gpt(config, block, seed)


def _attention_without_q_lora():
    """Megatron's ``MLASelfAttention``; where it resolves the latent norms itself (0.19+,
    ``_resolve_qk_norm_config``), a subclass whose resolver returns the spec's slots. Megatron's
    own resolver demands TE's fused norm-linear for ``linear_q_proj`` when ``qk_layernorm`` is
    set without ``q_lora_rank``, which no TE here cannot give; the slots returned are the modules
    0.15-0.18 build for the same spec (no q norm, the kv norm). The forward stays Megatron's."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if not hasattr(MLASelfAttention, "_resolve_qk_norm_config"):
        return MLASelfAttention

    class SpecSlotsMLASelfAttention(MLASelfAttention):
        def _resolve_qk_norm_config(self, submodules):
            return dict(linear_q_proj=submodules.linear_q_proj,
                        linear_q_up_proj=submodules.linear_q_up_proj,
                        linear_kv_up_proj=submodules.linear_kv_up_proj,
                        q_layernorm=IdentityOp, kv_layernorm=submodules.kv_layernorm)  # fmt: skip

    return SpecSlotsMLASelfAttention


def packed_params(lengths=PACKED):
    """thd parameters of one pack (``cu_seqlens_*_padded`` = the real ones: no padding)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))  # fmt: skip


def inputs(packed: bool, seed=1, lengths=PACKED):
    """``(input_ids, position_ids, forward kwargs)``: sbhd ``[2, 16]`` or one thd pack."""
    gen = torch.Generator().manual_seed(seed)
    if not packed:
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen)
        return ids, torch.arange(16).expand(2, 16), {}
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids, pos, {"packed_seq_params": packed_params(lengths)}


def logits_and_grads(model, packed: bool):
    """Logits and every parameter gradient of the mean cross entropy on seeded labels."""
    ids, pos, kwargs = inputs(packed)
    model.zero_grad(set_to_none=True)
    logits = model(ids, pos, None, **kwargs)
    labels = torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(7))
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads
