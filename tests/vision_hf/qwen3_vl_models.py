"""Tiny Qwen3-VL checkpoints for the tests: a 4-layer dense language model (GQA 4:2, head dim 16,
interleaved mRoPE sections 3/3/2; two pipeline stages of 2) and a 2-block vision tower (patch 4, temporal patch 2, merge
2, a 4 x 4 learned position table, deepstack after both blocks), every weight moved off its
initial value by N(0, 0.1) so norms and biases matter."""

from __future__ import annotations

import torch

IMAGE, VIDEO, START, END = 150, 151, 152, 153
VOCAB = 160
PATCH_DIM = 3 * 2 * 4 * 4  # channels x temporal patch x patch x patch


def tiny_config():
    from transformers import Qwen3VLConfig

    text = dict(
        hidden_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=VOCAB,
        max_position_embeddings=512,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2], mrope_interleaved=True
        ),
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=48,
        spatial_merge_size=2,
        patch_size=4,
        temporal_patch_size=2,
        in_channels=3,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=START,
        vision_end_token_id=END,
        tie_word_embeddings=False,
    )


def tiny_moe_config():
    """:func:`tiny_config` with Qwen3-VL-MoE's text stack: 4 experts of 32, top-2, the first
    layer dense (``mlp_only_layers``)."""
    from transformers import Qwen3VLMoeConfig

    dense = tiny_config()
    text = dense.text_config.to_dict()
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                decoder_sparse_step=1, mlp_only_layers=[0])  # fmt: skip
    for key in ("model_type", "architectures", "transformers_version"):
        text.pop(key, None)
    return Qwen3VLMoeConfig(text_config=text, vision_config=dense.vision_config.to_dict(),
                            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                            vision_end_token_id=END, tie_word_embeddings=False)  # fmt: skip


def tiny_model(seed: int = 0, *, moe: bool = False):
    """transformers' ``Qwen3VL(Moe)ForConditionalGeneration`` (fp32, eval) of :func:`tiny_config`
    (:func:`tiny_moe_config`)."""
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

    torch.manual_seed(seed)
    if moe:
        model = Qwen3VLMoeForConditionalGeneration(tiny_moe_config()).float().eval()
    else:
        model = Qwen3VLForConditionalGeneration(tiny_config()).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def image_prompt(grids, text=((5, 6), (7, 8), (9, 10, 11)), tokens=(START, IMAGE, END)):
    """``[1, S]`` ids: text, then per image ``START, IMAGE * (t·h·w/4), END`` (``tokens``),
    then text."""
    start, image, end = tokens
    ids = list(text[0])
    for (t, h, w), between in zip(grids, text[1:]):
        ids += [start] + [image] * (t * h * w // 4) + [end] + list(between)
    return torch.tensor([ids])


def pixels(grids, seed: int = 2) -> torch.Tensor:
    """``[P, PATCH_DIM]`` patches for ``grids``."""
    count = sum(t * h * w for t, h, w in grids)
    return torch.randn(count, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


GRIDS = ((1, 4, 6), (1, 2, 8))  # two images of different grids (patches)
EVEN_TEXT = ((5, 6), (7, 8), (9, 10, 11, 12))  # with GRIDS: 22 tokens, for sequence parallelism
# what the CPU needs of a bridge-built config (mbridge's defaults ask for CUDA fusions)
CPU_ARGS = dict(use_cpu_initialization=True, masked_softmax_fusion=False,
                bias_activation_fusion=False, bias_dropout_fusion=False,
                gradient_accumulation_fusion=False, variable_seq_lengths=False)  # fmt: skip


def save_tiny(path) -> str:
    """:func:`tiny_model` saved as safetensors (fp32) with its config; returns the path."""
    tiny_model().save_pretrained(path, safe_serialization=True)
    return str(path)
