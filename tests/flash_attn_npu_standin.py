"""A stand-in ``flash_attn_npu`` (no NPU here): ``flash_attn_func`` and ``flash_attn_varlen_func``
with the signatures MindSpeed core_r0.16.0's batch-invariant attention calls, recording every
call with its arguments and answering with the plugin's fixed-block reference, so models keep
computing real numbers while the calls are checked."""

from __future__ import annotations

import sys
import types

from mcore_npu.ops.batch_invariant import fixed_block_attention


class FlashAttnNpu(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("flash_attn_npu")
        self.calls: list[tuple[str, tuple, dict]] = []

    def flash_attn_func(
        self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
        alibi_slopes=None, deterministic=False, return_attn_probs=False,
    ):  # fmt: skip
        kwargs = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, alibi_slopes=alibi_slopes,
                      deterministic=deterministic, return_attn_probs=return_attn_probs)  # fmt: skip
        self.calls.append(("flash_attn_func", (q, k, v), kwargs))
        return fixed_block_attention(q, k, v, layout="BSND", causal=causal, scale=softmax_scale)

    def flash_attn_varlen_func(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
        softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
        deterministic=False, return_attn_probs=False, block_table=None,
    ):  # fmt: skip
        kwargs = dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, alibi_slopes=alibi_slopes,
                      deterministic=deterministic, return_attn_probs=return_attn_probs,
                      block_table=block_table)  # fmt: skip
        args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        self.calls.append(("flash_attn_varlen_func", args, kwargs))
        return fixed_block_attention(
            q, k, v, layout="TND", causal=causal, scale=softmax_scale, cu_seqlens=cu_seqlens_q
        )


def install(monkeypatch) -> FlashAttnNpu:
    """The stand-in as ``sys.modules["flash_attn_npu"]`` for the test."""
    standin = FlashAttnNpu()
    monkeypatch.setitem(sys.modules, "flash_attn_npu", standin)
    return standin
