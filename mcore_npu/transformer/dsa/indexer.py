"""The lightning indexer's projections: which keys each query attends to.

Megatron 0.19's ``DSAIndexer`` names (``linear_wq_b``, ``linear_wk``, ``k_norm``,
``linear_weights_proj``), replicated over TP ranks (gradients averaged over them). Heads are
``[pe, nope]``; the Hadamard rotation of DeepSeek's reference is skipped (orthogonal, so the
scores are unchanged)."""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from mcore_npu.transformer.dsa.settings import DSASettings


class DSAIndexer(MegatronModule):
    """Index queries ``[.., n, d]`` and one index key ``[.., 1, d]`` per token in the layer's
    dtype (the fused indexer takes fp16 / bf16; the reference scores in float32), and head
    weights ``[.., n]`` in float32, where ``..`` is ``[s, b]`` or thd's ``[t]``."""

    def __init__(self, config, settings: DSASettings):
        super().__init__(config=config)
        self.settings = settings
        n, d = settings.heads, settings.head_dim
        q_in = config.q_lora_rank if config.q_lora_rank is not None else config.hidden_size
        kw = dict(bias=False, dtype=config.params_dtype)
        self.linear_wq_b = torch.nn.Linear(q_in, n * d, **kw)
        self.linear_wk = torch.nn.Linear(config.hidden_size, d, **kw)
        self.k_norm = torch.nn.LayerNorm(d, eps=settings.k_norm_eps, dtype=config.params_dtype)
        self.linear_weights_proj = torch.nn.Linear(config.hidden_size, n, **kw)
        if config.perform_initialization:
            for linear in (self.linear_wq_b, self.linear_wk, self.linear_weights_proj):
                config.init_method(linear.weight)
        for param in self.parameters():  # the same on every TP rank
            param.average_gradients_across_tp_domain = True

    def forward(self, hidden, q_latent, rotate):
        """hidden ``[.., H]`` and the normalised query latent ``[.., q_lora_rank]`` (every
        token); ``rotate(x, kind)`` MLA's RoPE step on ``[.., heads, rope]`` in interleaved-pair
        order (DSA's attention reuses it)."""
        s = self.settings
        rope = self.config.qk_pos_emb_head_dim
        query = self.linear_wq_b(q_latent).unflatten(-1, (s.heads, s.head_dim))
        key = self.k_norm(self.linear_wk(hidden)).unsqueeze(-2)
        query, key = (self._turn(x, rope, rotate, kind) for x, kind in ((query, "q"), (key, "kv")))
        scale = (s.heads * s.head_dim) ** -0.5  # relu(a * c) = c * relu(a) for c > 0
        weights = self.linear_weights_proj(hidden).float() * scale
        return query, key, weights

    def _turn(self, x, rope: int, rotate, kind: str):
        """RoPE on the leading ``rope`` channels; halves mode goes through the pair-order step
        by interleaving the halves first."""
        pe, nope = x[..., :rope], x[..., rope:]
        if not self.settings.rope_interleaved:
            pe = torch.stack(pe.chunk(2, dim=-1), dim=-1).flatten(-2)
        return torch.cat([rotate(pe, kind), nope], dim=-1)
