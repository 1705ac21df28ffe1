"""``NPUSelfAttention``: Megatron's ``SelfAttention`` with its output gate computed eagerly.

Megatron's ``Attention._apply_output_gate`` (``attention_output_gate``: Qwen3.5, Qwen3-Next) is
``torch.compile``'d through ``jit_fuser``; here the same expression runs without compiling::

    core_attn_out [sq, b, np*hn] (thd: [t, 1, np*hn]), gate [sq, b, np, hn] -> (core_attn_out *
    sigmoid(gate.float())).to(core_attn_out.dtype)
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention


def apply_output_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` in float32, cast back to x's dtype; gate ``[.., np, hn]`` viewed as x
    ``[.., np*hn]``."""
    gate = gate.contiguous().view(*x.shape)
    return (x * torch.sigmoid(gate.float())).to(x.dtype)


class NPUSelfAttention(SelfAttention):
    """``SelfAttention`` whose output gate (``attention_output_gate``) runs eagerly."""

    def _apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return apply_output_gate(x, gate)
