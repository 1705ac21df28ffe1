"""Multi-Latent Attention (DeepSeek-V3's MLA) for the NPU spec, without Transformer Engine.

:class:`NPUMLASelfAttention` is Megatron's ``MLASelfAttention`` with
``MultiLatentAttention.__init__`` stood in for by :class:`_MLAConstruction` (next in the method
order) where a probe says Megatron's would raise on TE's ``MagicMock`` stand-in (megatron-core
0.16). Core attention gets MLA's softmax scale and ``k_channels`` / ``v_channels``: q/k with D =
qk_head_dim + qk_pos_emb_head_dim, v with ``v_head_dim``. The q/k/v training path runs here with
``rope_kernel`` set (the rope slice through ``rotary_mul``) or under tensor parallelism (the shared
``k_pos_emb`` gradient summed over TP ranks); inference, cached latents and ``apply_rope_fusion``
run Megatron's method. Nothing is patched. See docs/mla.md."""

from __future__ import annotations

import functools
import inspect
import math

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings import (
    RotaryEmbedding,
    YarnRotaryEmbedding,
    _yarn_get_mscale,
    apply_rotary_pos_emb,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MultiLatentAttention
from megatron.core.transformer.spec_utils import build_module

from mcore_npu.masks import SeqLengthsMemo
from mcore_npu.ops import rotary_mul
from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer import megatron_features
from mcore_npu.transformer.rope import RopeCosSinCache, packed_positions

__all__ = ["NPUMLASelfAttention", "megatron_mla_constructs"]


def megatron_mla_constructs() -> bool:
    """Whether Megatron's ``MultiLatentAttention.__init__`` is used as it is (not where TE's
    stand-in would make it raise). Probed on every call: a test flips the flag."""
    return not megatron_features.FEATURES["mla_te_stand_in"].probe()


class _MLAConstruction(MultiLatentAttention):
    """``MultiLatentAttention.__init__`` (megatron-core 0.16.1) without the TE-only fp8 branch, run
    where TE's stand-in would make Megatron's raise."""

    def __init__(
        self,
        config,
        submodules,
        layer_number,
        attn_mask_type,
        attention_type,
        cp_comm_type=None,
        pg_collection=None,
        **kwargs,
    ):
        common = dict(config=config, submodules=submodules, layer_number=layer_number)
        common.update(attn_mask_type=attn_mask_type, attention_type=attention_type)
        if megatron_mla_constructs():
            super().__init__(
                **common, cp_comm_type=cp_comm_type, pg_collection=pg_collection, **kwargs
            )
            return
        Attention.__init__(self, **common, pg_collection=pg_collection)
        self.query_projection_size = config.v_head_dim * config.num_attention_heads
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.key_hidden_size = self.q_head_dim
        self.val_hidden_size = config.v_head_dim
        self.recompute_up_proj = (
            config.recompute_granularity == "selective"
            and "mla_up_proj" in config.recompute_modules
        )
        self.qkv_up_checkpoint = None
        mscale = _yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
        self.softmax_scale = mscale * mscale / math.sqrt(self.q_head_dim)
        self.cache_mla_latents = getattr(config, "cache_mla_latents", False)
        self.rotary_pos_emb = _rotary_embedding(config, self.pg_collection.cp)
        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            layer_number=self.layer_number,
            attn_mask_type=self.attn_mask_type,
            attention_type=self.attention_type,
            softmax_scale=self.softmax_scale,
            k_channels=self.q_head_dim,
            v_channels=config.v_head_dim,
            cp_comm_type=cp_comm_type,
            pg_collection=self.pg_collection,
        )
        proj_kwargs = {}
        if _takes(submodules.linear_proj, "tp_group"):  # Megatron's linears do
            proj_kwargs["tp_group"] = self.pg_collection.tp
        self.linear_proj = build_module(
            submodules.linear_proj,
            self.query_projection_size,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="proj",
            **proj_kwargs,
        )


def _rotary_embedding(config, cp_group):
    """Megatron's RoPE module of MLA's rope slice."""
    dim = config.qk_pos_emb_head_dim
    if config.rope_type == "rope":
        return RotaryEmbedding(
            dim,
            rotary_percent=config.rotary_percent,
            rotary_base=config.rotary_base,
            cp_group=cp_group,
        )
    if config.rope_type == "yarn":
        return YarnRotaryEmbedding(
            dim,
            rotary_base=config.rotary_base,
            scaling_factor=config.rotary_scaling_factor,
            original_max_position_embeddings=config.original_max_position_embeddings,
            beta_fast=config.beta_fast,
            beta_slow=config.beta_slow,
            mscale=config.mscale,
            mscale_all_dim=config.mscale_all_dim,
            cp_group=cp_group,
        )
    raise ValueError(
        f"rope_type: unsupported RoPE type {config.rope_type!r} for multi-latent attention; "
        "pass 'rope' or 'yarn'"
    )


def _takes(target, name: str) -> bool:
    """Whether the class a spec slot builds takes keyword ``name`` (or any keyword)."""
    module = getattr(target, "module", target)
    try:
        parameters = inspect.signature(module.__init__).parameters
    except (TypeError, ValueError):
        return True
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


class NPUMLASelfAttention(MLASelfAttention, _MLAConstruction):
    """Megatron's ``MLASelfAttention``, constructible without TE; its q/k/v training path runs here
    with fused RoPE or under tensor parallelism.

    Args:
        config, submodules, layer_number, ...: Megatron's ``MLASelfAttention`` arguments.
        rope_kernel: None (Megatron's RoPE) | ``"auto"`` | ``"torch_npu"`` | ``"reference"`` for
            ``rotary_mul`` on the rope slice.
        seq_lengths_memo: the spec's cu_seqlens memo (host offsets for packed thd).
    """

    def __init__(
        self,
        config,
        submodules,
        layer_number,
        *args,
        rope_kernel: str | None = None,
        seq_lengths_memo: SeqLengthsMemo | None = None,
        **kwargs,
    ):
        if rope_kernel is not None:  # None: Megatron's own RoPE
            check_kernel(rope_kernel, what="rope_kernel")
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.rope_kernel = rope_kernel
        self.seq_lengths_memo = (
            seq_lengths_memo if seq_lengths_memo is not None else SeqLengthsMemo()
        )
        self.rope_cache = RopeCosSinCache(capacity=4)  # this layer's RoPE module: its angles

    def _resolve_qk_norm_config(self, submodules) -> dict:
        """The latent norms and up projections as the spec gives them (megatron-core 0.19+ asks
        this): a norm slot as it is (``IdentityOp`` where none), the q norm only with
        ``q_lora_rank``. Megatron's resolver would refuse the te layout's
        ``NormColumnParallelLinear``."""
        if self.config.qk_l2_norm:
            raise ValueError("qk_l2_norm: not supported with MLA; set qk_l2_norm=False")
        norm = {
            name: getattr(submodules, name, None) or IdentityOp
            for name in ("q_layernorm", "kv_layernorm")
        }
        if self.config.q_lora_rank is None:
            norm["q_layernorm"] = IdentityOp
        names = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
        return {**{name: getattr(submodules, name) for name in names}, **norm}

    def get_query_key_value_tensors(
        self,
        hidden_states,
        key_value_states=None,
        position_ids=None,
        packed_seq_params=None,
        inference_context=None,
        *,
        inference_params=None,
    ):
        """``(query, key, value, q_compressed, kv_compressed)`` (three where Megatron's forward
        takes three, 0.15): Megatron's, or this module's training path.

        Shapes (n: heads per TP rank, D = qk_head_dim + qk_pos_emb_head_dim): sbhd query/key
        ``[s, b, n, D]``, value ``[s, b, n, v_head_dim]``; thd ``[t, n, D]`` / ``[t, n, Dv]``."""
        context = inference_context if inference_context is not None else inference_params
        if not self._runs_here(context):
            args = (hidden_states, key_value_states, position_ids, packed_seq_params)
            return super().get_query_key_value_tensors(
                *args, inference_context=inference_context, inference_params=inference_params
            )
        config = self.config
        q_compressed, kv_compressed, k_pos_emb = self._latents(hidden_states, packed_seq_params)
        tokens = hidden_states.shape[0]  # the up-projected q's first dim (Megatron's q_len)
        if config.sequence_parallel:
            tokens *= self.pg_collection.tp.size()
        up = functools.partial(
            self._up_and_rotate, rotate=self._rotation(hidden_states, packed_seq_params, tokens)
        )
        if self.recompute_up_proj:  # as Megatron
            quantization = config.fp8 or getattr(config, "fp4", None)
            self.qkv_up_checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=quantization)
            query, key, value = self.qkv_up_checkpoint.checkpoint(
                up, q_compressed, kv_compressed, k_pos_emb
            )
        else:
            query, key, value = up(q_compressed, kv_compressed, k_pos_emb)
        if not megatron_features.has("mla_returns_latents"):
            return query, key, value
        return query, key, value, q_compressed, kv_compressed

    def _runs_here(self, inference_context) -> bool:
        """Training with fused RoPE or tensor parallelism runs here."""
        if inference_context is not None or self.cache_mla_latents:
            return False
        if self.config.apply_rope_fusion:
            return False
        return self.rope_kernel is not None or self.pg_collection.tp.size() > 1

    def _latents(self, hidden_states, packed_seq_params):
        """Down projections and latent norms: ``q_compressed`` (the hidden states without
        ``q_lora_rank``), ``kv_compressed`` and ``k_pos_emb`` per token. Unlike Megatron 0.16.1, the
        shared ``k_pos_emb``'s gradient is summed over the TP ranks, so TP=2 equals one process."""
        config = self.config
        rope = config.qk_pos_emb_head_dim
        if config.q_lora_rank is not None:
            q_compressed, _ = self.linear_q_down_proj(hidden_states)
            if q_compressed.size(-1) != config.q_lora_rank:  # a TP-sharded ColumnParallelLinear
                q_compressed = gather_from_tensor_model_parallel_region(q_compressed)
                if config.sequence_parallel:
                    q_compressed = scatter_to_sequence_parallel_region(q_compressed)
        else:
            q_compressed = hidden_states
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        split = [config.kv_lora_rank, rope]
        if kv_combined.size(-1) != config.kv_lora_rank + rope:
            kv_combined = gather_from_tensor_model_parallel_region(kv_combined)
            kv_compressed, k_pos_emb = torch.split(kv_combined, split, dim=-1)
            k_pos_emb = copy_to_tensor_model_parallel_region(k_pos_emb, group=self.pg_collection.tp)
            if config.sequence_parallel:
                kv_compressed = scatter_to_sequence_parallel_region(kv_compressed)
        else:
            kv_compressed, k_pos_emb = torch.split(kv_combined, split, dim=-1)
            if self.pg_collection.tp.size() > 1 and config.sequence_parallel:
                k_pos_emb = gather_from_sequence_parallel_region(
                    k_pos_emb, group=self.pg_collection.tp
                )
        if packed_seq_params is not None:  # [t, 1, ...] -> [t, ...]
            q_compressed, kv_compressed, k_pos_emb = (
                t.squeeze(1) for t in (q_compressed, kv_compressed, k_pos_emb)
            )
        if config.q_lora_rank is not None:
            q_compressed = self.q_layernorm(q_compressed)
        return q_compressed, self.kv_layernorm(kv_compressed), k_pos_emb

    def _up_and_rotate(self, q_compressed, kv_compressed, k_pos_emb, *, rotate):
        """Up projections, then the rope slices turned by ``rotate(x, "q" | "kv")``."""
        config = self.config
        heads, nope, rope = (
            self.num_attention_heads_per_partition,
            config.qk_head_dim,
            config.qk_pos_emb_head_dim,
        )
        project = self.linear_q_up_proj if config.q_lora_rank is not None else self.linear_q_proj
        q, _ = project(q_compressed)
        q = q.view(*q.shape[:-1], heads, self.q_head_dim)
        kv, _ = self.linear_kv_up_proj(kv_compressed)
        kv = kv.view(*kv.shape[:-1], heads, nope + config.v_head_dim)
        q_no_pe, q_pos_emb = torch.split(q, [nope, rope], dim=-1)
        k_no_pe, value = torch.split(kv, [nope, config.v_head_dim], dim=-1)
        q_pos_emb = rotate(q_pos_emb, "q")  # [tokens, (b,) n, rope]
        k_pos_emb = rotate(k_pos_emb.unsqueeze(-2), "kv")  # [tokens, (b,) 1, rope]
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        key = torch.cat([k_no_pe, k_pos_emb.expand(*k_no_pe.shape[:-1], rope)], dim=-1)
        return query.contiguous(), key.contiguous(), value.contiguous()

    def _rotation(self, hidden_states, packed_seq_params, tokens: int):
        """The rope step: ``rotary_mul`` with cached cos/sin (``rope_kernel`` set), else Megatron's
        ``apply_rotary_pos_emb`` with Megatron's angles."""
        config = self.config
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(
            None, None, hidden_states, config, packed_seq_params
        )
        angles = self.rotary_pos_emb(seq_len, packed_seq=packed)
        angles, mscale = angles if config.rope_type == "yarn" else (angles, 1.0)
        if self.rope_kernel is not None:
            cos, sin = self._mla_cos_sin(
                angles, mscale, hidden_states.dtype, packed_seq_params, tokens
            )
            return lambda x, _kind: self._rotate(x, cos, sin)
        if not packed or config.context_parallel_size == 1:
            angles = angles[:tokens]
        cu = {"q": None, "kv": None}
        if packed:
            params = packed_seq_params
            cu = {
                "q": _first(params.cu_seqlens_q_padded, params.cu_seqlens_q),
                "kv": _first(params.cu_seqlens_kv_padded, params.cu_seqlens_kv),
            }
        cp_group = self.pg_collection.cp

        def megatrons(x, kind):
            return apply_rotary_pos_emb(
                x, angles, config=config, cu_seqlens=cu[kind], mscale=mscale, cp_group=cp_group,
                **_MLA_PAIRS,
            )  # fmt: skip

        return megatrons

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x ``[s, b, n, rope]`` or thd ``[t, n, rope]``: the first ``cos.shape[-1]`` channels in
        MLA's order (even, then odd) through ``rotary_mul``, the rest passed on."""
        packed = x.dim() == 3
        if packed:
            x = x.unsqueeze(1)  # [t, 1, n, rope]
        rot = cos.shape[-1]
        turned, kept = x[..., :rot], x[..., rot:]
        turned = torch.cat((turned[..., 0::2], turned[..., 1::2]), dim=-1)
        mode = "interleave" if self.config.rotary_interleaved else "half"
        out = rotary_mul(turned, cos, sin, mode, kernel=self.rope_kernel)
        if kept.shape[-1]:
            out = torch.cat((out, kept), dim=-1)
        return out.squeeze(1) if packed else out

    def _mla_cos_sin(self, angles, mscale, dtype, packed_seq_params, tokens: int):
        """cos/sin ``[tokens, 1, 1, rot]`` with yarn's mscale at Megatron's positions (thd: per
        sequence from 0, this CP rank's chunks); cached per angles tensor and shape."""
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            what = ("sbhd", dtype, float(mscale), tokens)
            return self.rope_cache.cos_sin(
                angles, what, lambda: _cos_sin(angles[:tokens], mscale, dtype)
            )
        cp = self.pg_collection.cp
        cp_size, cp_rank = (cp.size(), cp.rank()) if cp is not None else (1, 0)
        used = angles[:tokens] if cp_size == 1 else angles  # Megatron shortens them without CP
        cu = _first(packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_q)
        ends = self.seq_lengths_memo.actual_seq_lengths(cu)
        what = ("thd", dtype, float(mscale), tokens, ends, cp_size, cp_rank)

        def make():
            exact = used.shape[0] == ends[-1]  # angles for every packed position
            index = packed_positions(ends, cp_size, cp_rank, exact)
            chosen = used.index_select(0, torch.tensor(index, device=angles.device))
            return _cos_sin(chosen, mscale, dtype)

        return self.rope_cache.cos_sin(angles, what, make)


# MLA's rope slice is in interleaved pairs: megatron-core 0.19 asks for that by keyword (its
# default is off), before it followed config.multi_latent_attention
_MLA_PAIRS = (
    {"mla_rotary_interleaved": True}
    if "mla_rotary_interleaved" in inspect.signature(apply_rotary_pos_emb).parameters
    else {}
)


def _first(*tensors):
    return next((t for t in tensors if t is not None), None)


def _cos_sin(angles: torch.Tensor, mscale: float, dtype: torch.dtype):
    """Megatron's ``(cos(emb) * mscale).to(dtype)``, ``(sin(emb) * mscale).to(dtype)``."""
    return (torch.cos(angles) * mscale).to(dtype), (torch.sin(angles) * mscale).to(dtype)
