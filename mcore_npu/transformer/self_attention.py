"""``NPUSelfAttention``: Megatron's ``SelfAttention`` with its output gate computed eagerly.

Megatron-Core 0.16.1 honours ``attention_output_gate`` (Qwen3.5, Qwen3-Next) in
``SelfAttention`` itself: ``linear_qkv`` gives per query group ``[q, gate, k, v]``
(``get_query_key_value_tensors(..., output_gate=True)``), and after core attention
``Attention._apply_output_gate`` multiplies by ``sigmoid(gate)``
(``megatron/core/transformer/attention.py``). That method is decorated with Megatron's
``jit_fuser``, which is ``torch.compile`` on torch >= 2.2: the first gated forward compiles it
(measured here: 70 s on this 2-core CPU for a 2-layer model, against 1.1 s for the next call),
and on an NPU it needs a ``torch.compile`` backend for the device. ``NPUSelfAttention`` keeps
everything of Megatron's and computes the same expression without compiling:

    core_attn_out [sq, b, np*hn] (thd: [t, 1, np*hn]), gate [sq, b, np, hn]
    -> (core_attn_out * sigmoid(gate.float())).to(core_attn_out.dtype)

Nothing of Megatron's is patched; the class is what the NPU spec puts in the
``self_attention`` slot (``NPUSpecProvider.self_attention``).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention


def apply_output_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` in float32, cast back to x's dtype (Megatron 0.16.1's
    ``Attention._apply_output_gate``); gate ``[.., np, hn]`` is viewed as x ``[.., np*hn]``."""
    gate = gate.contiguous().view(*x.shape)
    return (x * torch.sigmoid(gate.float())).to(x.dtype)


class NPUSelfAttention(SelfAttention):
    """``SelfAttention`` whose output gate (``attention_output_gate``) runs eagerly."""

    def _apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return apply_output_gate(x, gate)
