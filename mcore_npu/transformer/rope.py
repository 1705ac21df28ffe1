"""Fused RoPE in Megatron's ``SelfAttention``: ``npu_rotary_mul`` after the q/k norms.

:class:`NPURotarySelfAttention` keeps all of Megatron's code and moves only the rotation:
``forward`` stashes the angles and calls Megatron's ``forward`` with ``rotary_pos_emb=None``;
:meth:`~NPURotarySelfAttention.get_query_key_value_tensors` rotates q and k right after the q/k
norms through ``mcore_npu.ops.rotary_mul`` (SBND: q ``[s, b, np, hn]``, k ``[s, b, ng, hn]``, packed
thd as ``[t, 1, n, hn]``; cos/sin ``[s|t, 1, 1, rot]``), at Megatron's positions (thd: per sequence
from 0; CP: this rank's chunks; static KV cache: from the offset). cos/sin are made once per angles
tensor by a :class:`RopeCosSinCache` shared by the spec's layers; per-sample (mRoPE) angles
``[s, b, 1, rot]`` rotate here too. Megatron's own RoPE runs for dynamic batching, flash decode,
per-head angles, MLA, distinct q/k angles and cross attention. Nothing is patched. See
docs/moe.md (Fused RoPE)."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config as _yarn_mscale,  # as Attention.forward applies it
)

from mcore_npu.masks import SeqLengthsMemo
from mcore_npu.ops import rotary_mul
from mcore_npu.transformer.self_attention import NPUSelfAttention


class RopeCosSinCache:
    """``(cos, sin)`` per angles tensor (its identity, checked through a weak reference and its
    version counter), dtype, mscale and positions; LRU of ``capacity`` entries, ``builds`` counts
    the pairs made."""

    def __init__(self, capacity: int = 16) -> None:
        self.capacity = capacity
        self.builds = 0
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()

    def cos_sin(self, freqs: torch.Tensor, what: tuple, make) -> tuple[torch.Tensor, torch.Tensor]:
        """The pair for ``(freqs, what)``; ``make()`` builds it the first time."""
        key = (id(freqs), what)
        entry = self._entries.get(key)
        stamp = (freqs._version, freqs.data_ptr())
        if entry is not None and entry[0]() is freqs and entry[1] == stamp:
            self._entries.move_to_end(key)
            return entry[2]
        pair = make()
        self.builds += 1
        self._entries[key] = (weakref.ref(freqs), stamp, pair)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return pair

    def __len__(self) -> int:
        return len(self._entries)

    def __deepcopy__(self, memo) -> RopeCosSinCache:
        return RopeCosSinCache(self.capacity)  # a copied spec starts empty, like the memo


@dataclass(frozen=True)
class _Pending:
    """What one forward call rotates with (stashed until the q/k projection)."""

    freqs: torch.Tensor  # [S, 1, 1, rot] angles
    packed_seq_params: object | None
    offset: int | None  # static inference: the first position of this call


class NPURotarySelfAttention(NPUSelfAttention):
    """``SelfAttention`` whose RoPE runs through ``npu_rotary_mul``; the output gate as
    :class:`NPUSelfAttention` (eager).

    Args:
        config, submodules, layer_number, ...: Megatron's ``SelfAttention`` arguments.
        rope_kernel: ``"auto"`` | ``"torch_npu"`` | ``"reference"`` for ``rotary_mul``.
        rope_cache: the cos/sin cache shared by the spec's layers; a private one if None.
        seq_lengths_memo: the spec's cu_seqlens memo (host offsets for packed thd).
    """

    def __init__(
        self,
        config,
        submodules,
        layer_number,
        *args,
        rope_kernel: str = "auto",
        rope_cache: RopeCosSinCache | None = None,
        seq_lengths_memo: SeqLengthsMemo | None = None,
        **kwargs,
    ):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        from mcore_npu.ops.registry import check_kernel

        self.rope_kernel = check_kernel(rope_kernel, what="rope_kernel")
        self.rope_cache = rope_cache if rope_cache is not None else RopeCosSinCache()
        self.seq_lengths_memo = (
            seq_lengths_memo if seq_lengths_memo is not None else (SeqLengthsMemo())
        )
        self.rope_mode = "interleave" if config.rotary_interleaved else "half"
        self.rope_mscale = float(_yarn_mscale(config))
        self._pending: _Pending | None = None

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
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        """Megatron's ``forward`` with the rotation moved after the q/k norms, when it applies."""
        if inference_context is None:
            inference_context = inference_params
        freqs = self._fused_angles(rotary_pos_emb, key_value_states, inference_context)
        if freqs is not None:
            offset = None
            if inference_context is not None:
                offset = int(inference_context.sequence_len_offset or 0)
            self._pending = _Pending(freqs, packed_seq_params, offset)
            rotary_pos_emb = None  # Megatron's own RoPE is skipped; ours runs after the norms
        try:
            return super().forward(
                hidden_states,
                attention_mask,
                key_value_states=key_value_states,
                inference_context=inference_context,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
            )
        finally:
            self._pending = None

    def _fused_angles(self, rotary_pos_emb, key_value_states, inference_context):
        """The angles tensor when this module rotates; None when nothing rotates or Megatron keeps
        RoPE."""
        config = self.config
        no_rope = bool(config.no_rope_freq and config.no_rope_freq[self.layer_number - 1])
        if rotary_pos_emb is None or no_rope:
            return None
        if isinstance(rotary_pos_emb, tuple):
            q_emb, k_emb = rotary_pos_emb
            if q_emb is not k_emb:
                return None
            rotary_pos_emb = q_emb
        if key_value_states is not None or self.attention_type != "self":
            return None
        if inference_context is not None and (
            config.flash_decode or not inference_context.is_static_batching()
        ):
            return None
        if config.multi_latent_attention or rotary_pos_emb.dim() != 4:
            return None
        if rotary_pos_emb.shape[2] != 1:
            return None  # per-head angles: Megatron's own code
        return rotary_pos_emb  # [S, 1 | B, 1, rot]: B for per-sample (mRoPE) angles

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, *args, **kwargs):
        """Megatron's projection and q/k norms, then q and k rotated (when a forward asked)."""
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, *args, **kwargs)
        pending = self._pending
        if pending is None or not isinstance(out, tuple) or len(out) < 3:
            return out
        query, key, *rest = out
        params = pending.packed_seq_params
        packed = params is not None and getattr(params, "qkv_format", None) == "thd"
        if packed:
            q_cu = _first(params.cu_seqlens_q_padded, params.cu_seqlens_q)
            k_cu = _first(params.cu_seqlens_kv_padded, params.cu_seqlens_kv)
            query = self._rotate(query, self._packed_cos_sin(pending.freqs, q_cu, query))
            key = self._rotate(key, self._packed_cos_sin(pending.freqs, k_cu, key))
        else:
            cos_sin = self._sbhd_cos_sin(pending, query)
            query, key = self._rotate(query, cos_sin), self._rotate(key, cos_sin)
        return (query, key, *rest)

    def _rotate(self, x: torch.Tensor, cos_sin) -> torch.Tensor:
        """x ``[s, b, n, hn]``; the first ``rot`` channels rotate, the rest pass through."""
        cos, sin = cos_sin
        rot = cos.shape[-1]
        if rot == x.shape[-1]:
            return rotary_mul(x, cos, sin, self.rope_mode, kernel=self.rope_kernel)
        turned = rotary_mul(x[..., :rot], cos, sin, self.rope_mode, kernel=self.rope_kernel)
        return torch.cat((turned, x[..., rot:]), dim=-1)

    def _sbhd_cos_sin(self, pending: _Pending, x: torch.Tensor):
        freqs, start = pending.freqs, pending.offset
        what = ("sbhd", x.dtype, self.rope_mscale, start, x.shape[0])

        def make():
            angles = freqs if start is None else freqs[start : start + x.shape[0]]
            return self._cos_sin(angles, x.dtype)

        return self.rope_cache.cos_sin(freqs, what, make)

    def _packed_cos_sin(self, freqs: torch.Tensor, cu_seqlens: torch.Tensor, x: torch.Tensor):
        """Per-token cos/sin of a packed batch ``[t, 1, 1, rot]`` (positions restart per sequence;
        under CP this rank's chunks), from the memo's host offsets."""
        cp = self.pg_collection.cp
        cp_size, cp_rank = (cp.size(), cp.rank()) if cp is not None else (1, 0)
        ends = self.seq_lengths_memo.actual_seq_lengths(cu_seqlens)
        what = ("thd", x.dtype, self.rope_mscale, ends, cp_size, cp_rank)

        def make():
            exact = freqs.shape[0] == ends[-1]  # Megatron: angles for every packed position
            index = packed_positions(ends, cp_size, cp_rank, exact)
            angles = freqs.index_select(0, torch.tensor(index, device=freqs.device))
            return self._cos_sin(angles, x.dtype)

        return self.rope_cache.cos_sin(freqs, what, make)

    def _cos_sin(self, angles: torch.Tensor, dtype: torch.dtype):
        """Megatron's ``(cos(emb) * mscale).to(dtype)``, ``(sin(emb) * mscale).to(dtype)``."""
        return (
            (torch.cos(angles) * self.rope_mscale).to(dtype),
            (torch.sin(angles) * self.rope_mscale).to(dtype),
        )


def packed_positions(ends, cp_size: int = 1, cp_rank: int = 0, exact: bool = False) -> list[int]:
    """The angle row of every local token of a packed batch (host ints, no device sync).

    ``ends``: global (padded) cumulative ends without the leading 0. A sequence of length L gives
    positions ``0..L-1``, under CP this rank's chunks ``r`` and ``2·CP-1-r`` (L / 2CP tokens each).
    ``exact`` (the angles cover every packed position): offset by the sequence's start."""
    index, start = [], 0
    for end in ends:
        local = (end - start) // cp_size
        base = start if exact else 0
        if cp_size > 1:
            seg, full = local // 2, cp_size * local
            index += range(base + cp_rank * seg, base + (cp_rank + 1) * seg)
            index += range(base + full - (cp_rank + 1) * seg, base + full - cp_rank * seg)
        else:
            index += range(base, base + local)
        start = end
    return index


def _first(*tensors):
    return next((t for t in tensors if t is not None), None)
