"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) as an MLA self-attention for the NPU spec.

:class:`NPUDSASelfAttention` is the plugin's MLA (same parameters: ``linear_kv_up_proj`` keeps its
name, as in Megatron 0.19's ``AbsorbedMLASelfAttention``) whose training forward runs in the
absorbed form: the query's no-RoPE part is taken into the KV latent through
``linear_kv_up_proj``'s key rows, attention runs over the latent (one head) with the RoPE parts
apart, and the value rows map the output back. Under TP each rank has its heads' rows; keys and
the indexer see every token (SP gathers them). Inference is refused. See docs/dsa.md."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from mcore_npu.transformer.mla import NPUMLASelfAttention


class NPUDSASelfAttention(NPUMLASelfAttention):
    """MLA with a lightning indexer; ``core_attention`` is ``NPUSparseAttention``.

    Takes ``NPUMLASelfAttention``'s arguments; hidden states ``[s, b, H]`` (SP: ``[s/tp, b,
    H]``), thd ``[t, 1, H]``; returns ``(output, bias)`` as Megatron's attention does."""

    def forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        position_ids=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        if inference_context is not None or inference_params is not None:
            raise ValueError(
                "inference_context: DSA layers of the NPU spec train only; run inference "
                "through the rollout engine"
            )
        if key_value_states is not None or attention_bias is not None:
            raise ValueError("key_value_states / attention_bias: DSA is self-attention only")
        q_latent, kv_latent, k_pe = self._latents(hidden_states, packed_seq_params)
        tokens = k_pe.shape[0]  # every token of this rank's sequence (SP gathers k_pe)
        rotate = self._rotation(hidden_states, packed_seq_params, tokens)
        query, q_pe, v_rows = self._absorbed_query(q_latent)
        hidden = self._every_token(hidden_states.detach(), summed=False)
        out = self.core_attention(
            query,
            self._every_token(kv_latent).unsqueeze(-2),
            rotate(q_pe, "q"),
            rotate(k_pe.unsqueeze(-2), "kv"),
            hidden=hidden.squeeze(1) if packed_seq_params is not None else hidden,
            q_latent=self._every_token(q_latent.detach(), summed=False),
            rotate=rotate,
            packed_seq_params=packed_seq_params,
        )
        out = torch.einsum("...nl,nvl->...nv", out, v_rows).flatten(-2)  # each head's value
        if packed_seq_params is not None:
            out = out.unsqueeze(1)  # thd: [t, 1, n * v]
        return self.linear_proj(out)

    def _absorbed_query(self, q_latent):
        """``(q_nope @ W_uk [.., n, kv_lora_rank], q_pe [.., n, rope], W_uv [n, v, lora])``:
        ``linear_kv_up_proj``'s rows per head are ``[W_uk | W_uv]``."""
        config = self.config
        project = self.linear_q_up_proj if config.q_lora_rank is not None else self.linear_q_proj
        q, _ = project(q_latent)
        heads, nope = self.num_attention_heads_per_partition, config.qk_head_dim
        q_nope, q_pe = q.unflatten(-1, (heads, self.q_head_dim)).split(
            [nope, config.qk_pos_emb_head_dim], dim=-1
        )
        up = self.linear_kv_up_proj.weight.unflatten(0, (heads, nope + config.v_head_dim))
        k_rows, v_rows = up.split([nope, config.v_head_dim], dim=1)  # [n, nope | v, lora]
        return torch.einsum("...nd,ndl->...nl", q_nope, k_rows), q_pe, v_rows

    def _every_token(self, x, summed: bool = True):
        """``x`` over every token of this rank's sequence; with ``summed`` its gradient is the
        sum over TP ranks (each has some heads), as a column-parallel linear's input."""
        tp = self.pg_collection.tp
        if tp.size() == 1:
            return x
        packed = x.dim() == 2  # thd latents come squeezed: [t, c] -> gathered on dim 0
        if self.config.sequence_parallel:
            x = x.unsqueeze(1) if packed else x
            x = gather_from_sequence_parallel_region(x, group=tp)
            return x.squeeze(1) if packed else x
        return copy_to_tensor_model_parallel_region(x, group=tp) if summed else x
