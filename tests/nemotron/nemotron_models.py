"""A tiny random Nemotron-H checkpoint (transformers 5.25's ``NemotronHForCausalLM``, fp32).

Pattern ``M*M-M*``: 3 Mamba2 layers (4 heads of 16, 2 groups, state 16, chunk 8, conv 4 with a
bias), 2 attention layers (GQA 4/2 heads of 16, no RoPE), 1 squared-ReLU MLP (96); hidden 64,
vocab 128. :func:`draw` moves every norm, ``D`` and ``dt_bias`` away from its init.
"""

from __future__ import annotations

import torch

VOCAB = 128
PATTERN = "M*M-M*"
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    hybrid_override_pattern=PATTERN,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    mamba_num_heads=4,
    mamba_head_dim=16,
    n_groups=2,
    ssm_state_size=16,
    chunk_size=8,
    conv_kernel=4,
    use_conv_bias=True,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def tiny_config(**overrides):
    """transformers' ``NemotronHConfig`` of the tiny model, ``overrides`` applied."""
    from transformers import NemotronHConfig

    return NemotronHConfig(**{**CONFIG, **overrides})


def draw(model) -> None:
    """Weights from N(0, 0.1^2); every norm weight 1 + N(0, 0.2^2); ``D`` from N(1, 0.3^2);
    ``dt_bias`` from N(-1, 0.5^2); ``A_log`` from log U(1, 8); conv bias N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                param.copy_(1 + 0.2 * noise)
            elif name.endswith(".D"):
                param.copy_(1 + 0.3 * noise)
            elif name.endswith("dt_bias"):
                param.copy_(-1 + 0.5 * noise)
            elif name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(1, 8, generator=gen).log())
            else:
                param.copy_(0.1 * noise)


def save_tiny(path, **overrides):
    """Save the tiny checkpoint (safetensors, fp32) to ``path``; returns the transformers model
    (eval mode)."""
    from transformers import NemotronHForCausalLM

    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_config(**overrides))
    draw(model)
    model.save_pretrained(path)
    return model.eval()
