"""Tiny random GLM-5 and DeepSeek-V3.2 checkpoints (transformers 5.25's ``GlmMoeDsaForCausalLM``
and ``DeepseekV32ForCausalLM``, fp32, eager attention).

Both: hidden 64, vocab 128, 3 layers (the first dense: SwiGLU 96; then MoE: 4 routed experts of
32 in 2 groups, one group and top-2 chosen, sigmoid router with a drawn
``e_score_correction_bias``, top-k scaling 2.5, one shared expert); MLA with 4 heads, q_lora_rank
32, kv_lora_rank 32, q/k head dim 16 + 8 (RoPE), value head dim 16; the DSA indexer with 8 heads
of 32 and ``index_topk`` 5, smaller than every sequence of the tests. GLM-5: plain RoPE and
``rms_norm_eps`` 1e-5 (GLM-5's own); DeepSeek-V3.2: yarn (factor 4 over 32 positions) and
``rms_norm_eps`` 1e-6. :func:`draw` moves every norm weight and bias away from its init.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128
TOPK = 5
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=TOPK,
    first_k_dense_replace=1,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
CONFIGS = {
    "glm_moe_dsa": dict(rms_norm_eps=1e-5),
    "deepseek_v32": dict(
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
}
MODEL_TYPES = tuple(CONFIGS)
# the draw's seed per model: one whose index scores leave a margin at the k-th key for the tests'
# batches (test_dsa_models.py checks it; GLM-5 with seed 3 has an exact tie at 0, after ReLU)
SEEDS = {"glm_moe_dsa": 0, "deepseek_v32": 3}


def classes(model_type: str):
    """``(config class, causal-LM class)`` of transformers for ``model_type``."""
    import transformers

    if model_type == "glm_moe_dsa":
        return transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM
    return transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM


def tiny_config(model_type: str, **overrides):
    """transformers' config of the tiny model, ``overrides`` applied (eager attention)."""
    config_class, _ = classes(model_type)
    config = config_class(**{**COMMON, **CONFIGS[model_type], **overrides})
    config._attn_implementation = "eager"
    return config


def draw(model, seed: int = 0) -> None:
    """Weights from N(0, 0.1^2); norm weights 1 + N(0, 0.2^2), norm biases N(0, 0.1^2); the
    router's expert bias N(0, 0.05^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tensors = list(model.named_parameters()) + [
            (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")
        ]
        for name, tensor in tensors:
            noise = torch.randn(tensor.shape, generator=gen)
            if "norm" in name and name.endswith(".weight"):
                tensor.copy_(1 + 0.2 * noise)
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.05 * noise)
            else:
                tensor.copy_(0.1 * noise)


def save_tiny(model_type: str, path, seed: int | None = None, **overrides):
    """Save the tiny checkpoint (safetensors, fp32; drawn with ``seed``, default the model's in
    :data:`SEEDS`) to ``path``; returns the transformers model (eval mode, eager attention)."""
    _, model_class = classes(model_type)
    seed = SEEDS[model_type] if seed is None else seed
    torch.manual_seed(seed)
    model = model_class(tiny_config(model_type, **overrides))
    draw(model, seed)
    model.save_pretrained(path)
    model.config._attn_implementation = "eager"
    return model.eval()


def add_mtp_layer(path, seed: int = 7) -> dict[str, torch.Tensor]:
    """Add one MTP layer to the checkpoint at ``path`` (one ``model.safetensors``), as GLM-5 and
    DeepSeek-V3.2 ship it: ``model.layers.{L}.*`` (``L`` layers before it) holding ``enorm``,
    ``hnorm``, ``eh_proj [H, 2H]``, ``shared_head.norm`` and a decoder layer shaped as layer
    ``L - 1`` (MoE, a full indexer), its tensors that layer's plus noise; every value
    bf16-representable. Returns the new tensors."""
    import safetensors.torch

    file = Path(path) / "model.safetensors"
    saved = safetensors.torch.load_file(str(file))
    last = max(int(k.split(".")[2]) for k in saved if k.startswith("model.layers."))
    gen = torch.Generator().manual_seed(seed)
    hidden = saved["model.embed_tokens.weight"].shape[1]
    new = {
        f"model.layers.{last + 1}.{name}": shape_fn()
        for name, shape_fn in {
            "enorm.weight": lambda: 1 + 0.2 * torch.randn(hidden, generator=gen),
            "hnorm.weight": lambda: 1 + 0.2 * torch.randn(hidden, generator=gen),
            "eh_proj.weight": lambda: 0.1 * torch.randn(hidden, 2 * hidden, generator=gen),
            "shared_head.norm.weight": lambda: 1 + 0.2 * torch.randn(hidden, generator=gen),
        }.items()
    }
    prefix = f"model.layers.{last}."
    for name in sorted(k for k in saved if k.startswith(prefix)):
        tensor = saved[name]
        new[f"model.layers.{last + 1}.{name[len(prefix) :]}"] = tensor + 0.05 * torch.randn(
            tensor.shape, generator=gen
        )
    new = {k: v.to(torch.bfloat16).float().contiguous() for k, v in new.items()}
    safetensors.torch.save_file({**saved, **new}, str(file), metadata={"format": "pt"})
    return new
