"""Tiny Qwen3.5 / Qwen3-Next checkpoints (transformers 5.10.4 classes, random weights, fp32).

Every model: 4 layers, 3 Gated DeltaNet + 1 full attention (``full_attention_interval`` 4, the
default), hidden 64, vocab 128, GQA 4/2 heads of 16 with partial RoPE (a quarter of each head)
and the gated attention output, GDN 2 key heads of 16 and 4 value heads of 8 (grouped values,
K != V). The MoE ones: 4 experts, top-2, a gated shared expert. :func:`draw` moves every norm
away from its init, so that a norm taken as the wrong kind changes the logits.
"""

from __future__ import annotations

import torch

from tests.integrations.conftest import VOCAB

TEXT = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)  # fmt: skip
# Qwen3-VL's tiny tower without deepstack (patch 4, temporal patch 2, merge 2, a 4 x 4 table)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=16)  # fmt: skip
# image, video, vision start and end: the vocabulary's last four ids
IMAGE_IDS = dict(image_token_id=VOCAB - 4, video_token_id=VOCAB - 3,
                 vision_start_token_id=VOCAB - 2, vision_end_token_id=VOCAB - 1)  # fmt: skip
KINDS = ("dense", "moe", "next", "hub")


def model_class_and_config(kind: str):
    """``(transformers model class, config)`` of a tiny checkpoint: ``dense`` (Qwen3.5),
    ``moe`` (Qwen3.5-MoE), ``next`` (Qwen3-Next), ``hub`` (Qwen3.5-MoE's vision-language
    class, the form hub checkpoints have; a 2-block vision tower)."""
    import transformers

    if kind == "dense":
        config = transformers.Qwen3_5TextConfig(**TEXT, intermediate_size=96)
        return transformers.Qwen3_5ForCausalLM, config
    if kind == "moe":
        return transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig(**TEXT, **MOE)
    if kind == "next":
        config = transformers.Qwen3NextConfig(**TEXT, **MOE, intermediate_size=96)
        return transformers.Qwen3NextForCausalLM, config
    if kind == "hub":
        config = transformers.Qwen3_5MoeConfig(text_config=dict(**TEXT, **MOE),
                                               vision_config=VISION, **IMAGE_IDS)  # fmt: skip
        return transformers.Qwen3_5MoeForConditionalGeneration, config
    raise ValueError(f"kind: {kind!r}; pass one of {', '.join(KINDS)}")


def draw(model) -> None:
    """Every weight from N(0, 0.1^2); zero-centred norms from N(0, 0.2^2), the GDN output norm
    from 1 + N(0, 0.2^2); A_log kept (transformers' log U(0, 16)), dt_bias from N(1, 0.1^2);
    the vision tower moved off its init by N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1 + 0.2 * noise)
            elif "norm" in name:
                param.copy_(0.2 * noise)
            elif "visual" in name:
                param.add_(0.1 * noise)
            elif name.endswith("A_log"):
                continue
            elif name.endswith("dt_bias"):
                param.copy_(1 + 0.1 * noise)
            else:
                param.copy_(0.1 * noise)


def save_tiny(path, kind: str, *, bf16_exact: bool = False):
    """Save the tiny ``kind`` checkpoint (safetensors, fp32) to ``path``; returns the
    transformers model (eval mode). ``bf16_exact``: every weight rounded to bf16 first (stored
    in fp32), so a model loaded in bf16 holds the same numbers."""
    model_class, config = model_class_and_config(kind)
    torch.manual_seed(0)
    model = model_class(config)
    draw(model)
    if bf16_exact:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(torch.bfloat16).float())
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()
