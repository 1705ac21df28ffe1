"""Multi-Latent Attention (DeepSeek-V3's MLA) for the NPU spec, without Transformer Engine.

megatron-core 0.16.x cannot build its own ``MLASelfAttention`` without TE:
``multi_latent_attention.py`` sets ``HAVE_TE`` from an import that succeeds without TE (the
extension module substitutes a ``MagicMock``), so ``MultiLatentAttention.__init__`` evaluates
``isinstance(self.linear_proj, TELinear)`` with a mock for the class and raises ``TypeError``.
Megatron-LM fixed it from core_v0.17.0 (Python >= 3.12); 0.15.x only evaluates the test with
fp8 on.

:class:`NPUMLASelfAttention` is Megatron's ``MLASelfAttention``, with every line of it (the
projections, the down-projections' exact-class check, the latent norms, yarn, forward) except
``MultiLatentAttention.__init__``, which :class:`_MLAConstruction` stands in for: it sits between
the two classes in the method resolution order, so ``MLASelfAttention.__init__``'s
``super().__init__`` reaches it. Where Megatron's own constructor works (a probe of the module's
``HAVE_TE`` and ``TELinear``, never its version: TE installed, the upstream fix, or no TE stub),
it simply calls it. Otherwise it runs the same statements minus the TE-only fp8 branch. Megatron's
module global stays untouched; nothing is patched.

Core attention is the spec's ``NPUFusionAttention``, built with MLA's softmax scale
(``mscale² / sqrt(qk_head_dim + qk_pos_emb_head_dim)``, yarn's concentration factor included) and
``k_channels`` / ``v_channels``: q/k reach it with D = qk_head_dim + qk_pos_emb_head_dim, v with
``v_head_dim`` (``mla_value_padding`` decides whether v is padded for the operator).

The training path of ``get_query_key_value_tensors`` runs here in two cases (its lines are
Megatron 0.16.1's, named in the methods), otherwise Megatron's own method does:

- ``rope_kernel`` set (the spec's fused RoPE, ``npu_rotary_mul``): the rope slice alone
  (``qk_pos_emb_head_dim`` channels of q, the one shared k_pos_emb of k) is rotated by
  ``mcore_npu.ops.rotary_mul``, in Megatron's MLA channel order (even channels, then odd), with
  yarn's mscale on cos/sin; cos/sin made once per layer per angles tensor and shape.
- tensor parallelism: Megatron 0.16.1 leaves the gradient of the shared ``k_pos_emb`` with each
  rank's own heads' share after its TP-sharded down projection; here it is summed over the TP
  ranks, so that TP=2 equals one process (see ``_latents``).

Inference, cached latents and Megatron's fused MLA RoPE (``apply_rope_fusion``) always go to
Megatron's own method.
"""

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
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MultiLatentAttention,
)
from megatron.core.transformer.spec_utils import build_module

from mcore_npu.masks import SeqLengthsMemo
from mcore_npu.ops import rotary_mul
from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer import megatron_features
from mcore_npu.transformer.rope import RopeCosSinCache, packed_positions

__all__ = ["NPUMLASelfAttention", "megatron_mla_constructs"]


def megatron_mla_constructs() -> bool:
    """Whether Megatron's ``MultiLatentAttention.__init__`` is used as it is: not where TE's
    ``MagicMock`` stand-in would make its ``isinstance(..., TELinear)`` raise (megatron-core
    0.16 always, 0.15 with fp8). Probed on every call, not cached: a test flips the flag."""
    return not megatron_features.FEATURES["mla_te_stand_in"].probe()


class _MLAConstruction(MultiLatentAttention):
    """``MultiLatentAttention.__init__`` (megatron-core 0.16.1 ``multi_latent_attention.py``
    lines 90-199), run where TE's stand-in would make Megatron's raise; see the module doc."""

    def __init__(self, config, submodules, layer_number, attn_mask_type, attention_type,
                 cp_comm_type=None, pg_collection=None, **kwargs):  # fmt: skip
        if megatron_mla_constructs():
            super().__init__(
                config=config, submodules=submodules, layer_number=layer_number,
                attn_mask_type=attn_mask_type, attention_type=attention_type,
                cp_comm_type=cp_comm_type, pg_collection=pg_collection, **kwargs,
            )  # fmt: skip
            return
        # lines 101-108: Attention's own set-up
        Attention.__init__(
            self, config=config, submodules=submodules, layer_number=layer_number,
            attention_type=attention_type, attn_mask_type=attn_mask_type,
            pg_collection=pg_collection,
        )  # fmt: skip
        # lines 111-126: MLA's sizes, recompute switch and softmax scale
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
        self.rotary_pos_emb = _rotary_embedding(config, self.pg_collection.cp)  # lines 128-153
        self.core_attention = build_module(  # lines 155-166
            submodules.core_attention, config=config, layer_number=self.layer_number,
            attn_mask_type=self.attn_mask_type, attention_type=self.attention_type,
            softmax_scale=self.softmax_scale, k_channels=self.q_head_dim,
            v_channels=config.v_head_dim, cp_comm_type=cp_comm_type,
            pg_collection=self.pg_collection,
        )  # fmt: skip
        proj_kwargs = {}
        if _takes(submodules.linear_proj, "tp_group"):  # Megatron's linears do
            proj_kwargs["tp_group"] = self.pg_collection.tp
        self.linear_proj = build_module(  # lines 169-181
            submodules.linear_proj, self.query_projection_size, config.hidden_size,
            config=config, init_method=config.output_layer_init_method,
            bias=config.add_bias_linear, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="proj", **proj_kwargs,
        )  # fmt: skip
        # lines 183-199 (TE fp8/fp4: set_save_original_input on a TELinear) have no TE here


def _rotary_embedding(config, cp_group):
    """Megatron's RoPE module of MLA's rope slice (0.16.1 lines 128-153)."""
    dim = config.qk_pos_emb_head_dim
    if config.rope_type == "rope":
        return RotaryEmbedding(
            dim, rotary_percent=config.rotary_percent, rotary_base=config.rotary_base,
            cp_group=cp_group,
        )  # fmt: skip
    if config.rope_type == "yarn":
        return YarnRotaryEmbedding(
            dim, rotary_base=config.rotary_base, scaling_factor=config.rotary_scaling_factor,
            original_max_position_embeddings=config.original_max_position_embeddings,
            beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
            mscale_all_dim=config.mscale_all_dim, cp_group=cp_group,
        )  # fmt: skip
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
    """Megatron's ``MLASelfAttention``, constructible without TE; its q/k/v training path runs
    here with fused RoPE or under tensor parallelism (see the module doc).

    Args:
        config, submodules, layer_number, attn_mask_type, cp_comm_type, pg_collection:
            Megatron's ``MLASelfAttention`` arguments (an ``MLATransformerConfig``; the down
            projections must be exactly ``ColumnParallelLinear``, Megatron's own check).
        rope_kernel: None (Megatron's RoPE) | ``"auto"`` | ``"torch_npu"`` | ``"reference"``
            for ``rotary_mul`` on the rope slice.
        seq_lengths_memo: the spec's cu_seqlens memo (host offsets for packed thd).
    """

    def __init__(self, config, submodules, layer_number, *args, rope_kernel: str | None = None,
                 seq_lengths_memo: SeqLengthsMemo | None = None, **kwargs):  # fmt: skip
        if rope_kernel is not None:  # None: Megatron's own RoPE
            check_kernel(rope_kernel, what="rope_kernel")
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.rope_kernel = rope_kernel
        self.seq_lengths_memo = seq_lengths_memo if seq_lengths_memo is not None else (
            SeqLengthsMemo())  # fmt: skip
        self.rope_cache = RopeCosSinCache(capacity=4)  # this layer's RoPE module: its angles

    def _resolve_qk_norm_config(self, submodules) -> dict:
        """The latent norms and up projections to build, as the spec gives them (megatron-core
        0.19+ asks this method; earlier releases read the slots directly, the same rule).

        Megatron's own resolver (``mla_qk_norm_config.QKNormConfigResolver``) reads its
        default backend (TE's, from ``config.transformer_impl``): it takes only TE's fused
        norm-linear as one (the te layout's ``NormColumnParallelLinear`` is refused) and
        refuses a q norm without ``q_lora_rank``, which 0.15-0.18 build as unused (the local
        spec's ``qk_layernorm=True``). Here, as in 0.16.1: a norm slot is used as it is
        (``IdentityOp`` where the spec has none), the q norm only with ``q_lora_rank``.
        """
        if self.config.qk_l2_norm:
            raise ValueError("qk_l2_norm: not supported with MLA; set qk_l2_norm=False")
        norm = {name: getattr(submodules, name, None) or IdentityOp
                for name in ("q_layernorm", "kv_layernorm")}  # fmt: skip
        if self.config.q_lora_rank is None:
            norm["q_layernorm"] = IdentityOp
        return dict(linear_q_proj=submodules.linear_q_proj,
                    linear_q_up_proj=submodules.linear_q_up_proj,
                    linear_kv_up_proj=submodules.linear_kv_up_proj, **norm)  # fmt: skip

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None,
                                    inference_context=None, *, inference_params=None):  # fmt: skip
        """``(query, key, value, q_compressed, kv_compressed)`` (``(query, key, value)`` where
        Megatron's forward takes three, 0.15): Megatron's, or this module's training path
        (``rope_kernel`` set, or tensor parallelism; see the module doc).

        Shapes (n: heads per TP rank, D = qk_head_dim + qk_pos_emb_head_dim): sbhd query/key
        ``[s, b, n, D]``, value ``[s, b, n, v_head_dim]``; thd ``[t, n, D]`` / ``[t, n, Dv]``.
        """
        context = inference_context if inference_context is not None else inference_params
        if not self._runs_here(context):
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, position_ids, packed_seq_params,
                inference_context=inference_context, inference_params=inference_params,
            )  # fmt: skip
        config = self.config
        q_compressed, kv_compressed, k_pos_emb = self._latents(hidden_states, packed_seq_params)
        tokens = hidden_states.shape[0]  # the up-projected q's first dim (Megatron's q_len)
        if config.sequence_parallel:
            tokens *= self.pg_collection.tp.size()
        up = functools.partial(
            self._up_and_rotate, rotate=self._rotation(hidden_states, packed_seq_params, tokens)
        )
        if self.recompute_up_proj:  # as Megatron (0.16.1 lines 838-843)
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
        """Training with fused RoPE or tensor parallelism runs here; inference, cached latents
        and Megatron's own fused MLA RoPE (``apply_rope_fusion``) run Megatron's method."""
        if inference_context is not None or self.cache_mla_latents:
            return False
        if self.config.apply_rope_fusion:
            return False
        return self.rope_kernel is not None or self.pg_collection.tp.size() > 1

    def _latents(self, hidden_states, packed_seq_params):
        """Down projections and latent norms (0.16.1 lines 580-640): ``q_compressed`` (or the
        hidden states without ``q_lora_rank``), ``kv_compressed`` and ``k_pos_emb`` per token.

        One change: under tensor parallelism every rank's heads read the one shared
        ``k_pos_emb``, so its gradient is summed over the TP ranks
        (``copy_to_tensor_model_parallel_region``). Megatron 0.16.1 keeps each rank's own heads'
        share after its TP-sharded down projection: the ``kv_down_proj`` weight gradient and
        everything below it then differ from one process (measured 3.3e-4 on a tiny model).
        """
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
        """Up projections, then the rope slices rotated (0.16.1 lines 714-836 without
        inference); ``rotate(x, cu_seqlens_kind)`` turns a rope slice (``"q"`` / ``"kv"``)."""
        config = self.config
        heads, nope, rope = (self.num_attention_heads_per_partition, config.qk_head_dim,
                             config.qk_pos_emb_head_dim)  # fmt: skip
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
        """The rope step: ``rotary_mul`` with cached cos/sin (``rope_kernel`` set), else
        Megatron's ``apply_rotary_pos_emb`` with the angles Megatron gives it (0.16.1 lines
        541-576, 776-819)."""
        config = self.config
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, config,
                                                         packed_seq_params)  # fmt: skip
        angles = self.rotary_pos_emb(seq_len, packed_seq=packed)
        angles, mscale = angles if config.rope_type == "yarn" else (angles, 1.0)
        if self.rope_kernel is not None:
            cos, sin = self._mla_cos_sin(angles, mscale, hidden_states.dtype, packed_seq_params,
                                         tokens)  # fmt: skip
            return lambda x, _kind: self._rotate(x, cos, sin)
        if not packed or config.context_parallel_size == 1:
            angles = angles[:tokens]
        cu = {"q": None, "kv": None}
        if packed:
            cu = {"q": _first(packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_q),
                  "kv": _first(packed_seq_params.cu_seqlens_kv_padded,
                               packed_seq_params.cu_seqlens_kv)}  # fmt: skip

        def megatrons(x, kind):
            return apply_rotary_pos_emb(x, angles, config=config, cu_seqlens=cu[kind],
                                        mscale=mscale, cp_group=self.pg_collection.cp)  # fmt: skip

        return megatrons

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x ``[s, b, n, rope]`` or thd ``[t, n, rope]``: the first ``rot = cos.shape[-1]``
        channels in MLA's order (even channels, then odd: Megatron's
        ``_apply_rotary_pos_emb_bshd`` for MLA) through ``rotary_mul``, the rest passed on."""
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
        """cos/sin ``[tokens, 1, 1, rot]`` with yarn's mscale, positions as Megatron's: sbhd the
        first ``tokens`` (under CP this rank's chunks already), thd per sequence from 0 (under
        CP this rank's two chunks of each), from the memo's host offsets. Cached per angles
        tensor (the RoPE module's forward is an lru_cache) and shape."""
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


def _first(*tensors):
    return next((t for t in tensors if t is not None), None)


def _cos_sin(angles: torch.Tensor, mscale: float, dtype: torch.dtype):
    """Megatron's ``(cos(emb) * mscale).to(dtype)``, ``(sin(emb) * mscale).to(dtype)``."""
    return (torch.cos(angles) * mscale).to(dtype), (torch.sin(angles) * mscale).to(dtype)
