"""``NPUFusionAttention``: Megatron-Core's core-attention slot, filled by one fused call.

Megatron's ``SelfAttention`` hands over q/k/v, the mask and ``packed_seq_params``; this makes one
``mcore_npu.ops.fusion_attention`` call (np: query heads, ng: kv groups, hn: head dim): sbhd q
``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]`` as SBH -> ``[sq, b, np*hn]``; packed thd q
``[t, np, hn]``, k/v ``[t, ng, hn]`` as TND -> ``[t, np*hn]``. K/V are never repeated. Masks come
from ``mcore_npu.masks.describe_mask``: Megatron's polarity (True = masked out) is the operator's;
verl's ``[B, S]`` key-padding mask (True = real token) becomes a causal description. Under CP
``cp_comm_type`` picks an algorithm of :mod:`mcore_npu.transformer.context_parallel`. No writes to
``config``, no patching."""

from __future__ import annotations

import contextlib
import math

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from mcore_npu.allocator import device as accelerator
from mcore_npu.masks import (
    BottomRightCausalMask,
    FullAttention,
    Packed,
    SeqLengthsMemo,
    SlidingWindow,
    TopLeftCausalMask,
    describe_mask,
)
from mcore_npu.ops import batch_invariant, batch_invariant_rows, fusion_attention, registry
from mcore_npu.ops import value_padding as padding
from mcore_npu.ops.batch_invariant import batch_invariant_attention
from mcore_npu.ops.registry import check_kernel
from mcore_npu.transformer import context_parallel
from mcore_npu.transformer.extra_state import EmptyExtraState


class NPUFusionAttention(MegatronModule):
    """Core attention through ``npu_fusion_attention`` (or its reference off-NPU).

    Args:
        cp_comm_type: the CP algorithm (``"p2p"``, ``"all_gather"``, ``"a2a"``); None =
            ``config.cp_comm_type`` (a string or a per-layer list), else ``"p2p"``.
        kernel: ``"auto"`` (torch_npu on NPU tensors, else the reference), ``"torch_npu"`` or
            ``"reference"``.
        seq_lengths_memo: shared by all layers so cu_seqlens becomes host offsets once per step.
        k_channels, v_channels: MLA's q/k and value head dims; None = ``config.kv_channels``.
        value_padding: ``"auto"`` | ``"on"`` | ``"off"``: pad a smaller value head dim for the
            operator.
        batch_invariant: batch-invariant mode: ``mcore_npu.ops.batch_invariant_attention``
            instead of ``fusion_attention`` (flash_attn_npu on an NPU, the fixed-block reference
            elsewhere; ``kernel="torch_npu"`` asks for flash_attn_npu by name); the mode's limits
            and its NPU kernel are checked here, one line each.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        *,
        kernel: str = "auto",
        seq_lengths_memo: SeqLengthsMemo | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        value_padding: str = "auto",
        batch_invariant: bool = False,
        **kwargs,
    ):
        super().__init__(config=config)
        _check_supported(config, kernel)
        self.value_padding = padding.check_mode(value_padding)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.kernel = kernel
        self.seq_lengths_memo = (
            seq_lengths_memo if seq_lengths_memo is not None else SeqLengthsMemo()
        )

        tp_size = _tensor_parallel_size(kwargs)
        self.num_heads_per_partition = _divide(config.num_attention_heads, tp_size, "heads")
        self.num_query_groups_per_partition = _divide(config.num_query_groups, tp_size, "groups")
        self.head_dim = config.kv_channels if k_channels is None else k_channels
        self.softmax_scale = _softmax_scale(softmax_scale, self.head_dim)
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.window_size = _layer_window(config, self.layer_number)
        self.cp_group, self.cp_comm_type = None, None
        if getattr(config, "context_parallel_size", 1) > 1:
            self.cp_comm_type = context_parallel.layer_comm_type(
                config, self.layer_number, cp_comm_type
            )
            context_parallel.rules.check(
                self.cp_comm_type,
                config.context_parallel_size,
                heads=self.num_heads_per_partition,
                groups=self.num_query_groups_per_partition,
            )
            self.cp_group = context_parallel.context_parallel_group(kwargs.get("pg_collection"))
        self.batch_invariant = batch_invariant
        if batch_invariant:
            self._check_batch_invariant(v_channels)

    def _check_batch_invariant(self, v_channels: int | None) -> None:
        """The mode's limits (one ValueError line each) and, on an NPU, its kernel (ImportError
        naming the package)."""
        kind = getattr(self.attn_mask_type, "name", self.attn_mask_type)
        if v_channels is not None and v_channels != self.head_dim:
            raise ValueError(
                f"batch-invariant mode does not support a value head dim ({v_channels}) other "
                f"than the query's ({self.head_dim}), as Multi-Latent Attention has: use a model "
                "without MLA"
            )
        batch_invariant.check_limits(
            context_parallel_size=getattr(self.config, "context_parallel_size", 1),
            dropout=self.dropout_p,
            head_dim=self.head_dim,
            mask_kind=kind,
            window=self.window_size,
        )
        on_npu = accelerator.is_npu_available()
        missing = batch_invariant.missing_kernel(on_npu) or batch_invariant_rows.missing_kernel(
            on_npu
        )
        if missing:
            raise ImportError(missing)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        **kwargs,
    ) -> torch.Tensor:
        """sbhd: ``[sq, b, np, hn]`` -> ``[sq, b, np*hv]``; thd: ``[t, np, hn]`` -> ``[t, np*hv]``
        (hv: the value's head dim)."""
        head_dim_v = value.shape[-1]
        padded = head_dim_v < query.shape[-1] and self._pads_value(query.device)
        if padded:
            value = padding.pad(value, query.shape[-1])  # MLA on an older torch_npu
        masks = (attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        out = self._attend(query, key, value, *masks)
        return padding.unpad(out, self.num_heads_per_partition, head_dim_v) if padded else out

    def _pads_value(self, device) -> bool:
        """Whether v (Dv < D) is padded to D here."""
        kernel = registry.resolve("fusion_attention", self.kernel, device).kernel
        return padding.pads(self.value_padding, kernel, device)

    def _attend(
        self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
    ) -> torch.Tensor:
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        seq_q, seq_kv = query.shape[0], key.shape[0]
        mask = describe_mask(
            attn_mask_type if attn_mask_type is not None else self.attn_mask_type,
            attention_mask,
            seq_q=seq_q,
            seq_kv=seq_kv,
            batch=None if packed else query.shape[1],
            packed_seq_params=packed_seq_params,
            window_size=self.window_size,
            memo=self.seq_lengths_memo,
        )
        if self.batch_invariant:
            return self._attend_batch_invariant(query, key, value, mask, attention_bias)
        keep_prob = 1.0 - self.dropout_p if self.training else 1.0
        if self.cp_group is not None:
            return self._context_parallel(
                query, key, value, mask, attention_bias, keep_prob, packed_seq_params
            )
        op_kwargs = mask.operator_args(query.device).as_kwargs()
        pse = self._bias(attention_bias, query, seq_q, seq_kv, packed)
        if pse is not None:
            op_kwargs["pse"] = pse
        if packed:  # [t, np, hn] stays [t, np, hn]: layout TND
            layout, q, k, v = "TND", query, key, value
        else:  # [s, b, n, hn] -> [s, b, n*hn] (a view for contiguous inputs): layout SBH
            layout, q, k, v = "SBH", query.flatten(2), key.flatten(2), value.flatten(2)
        with self._dropout_rng(keep_prob):
            op_kwargs.update(kernel=self.kernel, scale=self.softmax_scale, keep_prob=keep_prob)
            out = fusion_attention(q, k, v, self.num_heads_per_partition, layout, **op_kwargs)
        _check_value_width(out, value.shape[-1], self.num_heads_per_partition, layout)
        return out.flatten(1) if packed else out  # thd: [t, np, hn] -> [t, np*hn]

    def _attend_batch_invariant(self, query, key, value, mask, attention_bias) -> torch.Tensor:
        """sbhd ``[s, b, n, hn]`` -> ``[s, b, n*hn]``; thd ``[t, n, hn]`` -> ``[t, n*hn]``."""
        if attention_bias is not None:
            raise ValueError(
                "batch-invariant mode does not support attention_bias: use a model without one"
            )
        call = dict(scale=self.softmax_scale, kernel=_INVARIANT_KERNEL[self.kernel])
        if isinstance(mask, Packed):
            ends = (0, *mask.lengths.q)
            if mask.lengths.q != mask.lengths.kv:
                raise ValueError(
                    "batch-invariant mode does not support packed cross attention: use "
                    "self-attention"
                )
            longest = max(e - s for s, e in zip(ends[:-1], ends[1:], strict=True))
            cu = torch.tensor(ends, dtype=torch.int32, device=query.device)
            causal = _invariant_causal(mask.within, packed=True)
            out = batch_invariant_attention(
                query, key, value, layout="TND", causal=causal, cu_seqlens=cu,
                max_seqlen=longest, **call,
            )  # fmt: skip
            return out.flatten(1)  # [t, n, hn] -> [t, n*hn]
        causal = _invariant_causal(mask)
        # [s, b, n, hn] -> [b, s, n, hn]
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        out = batch_invariant_attention(q, k, v, layout="BSND", causal=causal, **call)
        return out.transpose(0, 1).flatten(2)  # [b, s, n, hn] -> [s, b, n*hn]

    def _context_parallel(
        self, query, key, value, mask, attention_bias, keep_prob, packed_seq_params
    ):
        """Under CP: sbhd ``[s/CP, b, np, hn]`` (chunks r, 2CP-1-r) -> ``[s/CP, b, np*hn]``; thd
        ``[t/CP, np, hn]`` (chunks r, 2CP-1-r of every sequence) -> ``[t/CP, np*hn]``."""
        where = f"context parallelism (cp_comm_type={self.cp_comm_type!r})"
        if attention_bias is not None:
            raise NotImplementedError(
                f"attention_bias under {where}: a bias over the whole sequence would have to "
                "travel with every block; fix: context_parallel_size=1 for biased attention"
            )
        thd_ends = None
        if isinstance(mask, Packed):
            thd_ends = self._thd_ends(mask, packed_seq_params, query.shape[0], where)
            mask = mask.within
        causal, window = _cp_mask(mask, where)
        call = dict(heads=self.num_heads_per_partition, scale=self.softmax_scale, causal=causal)
        call.update(kernel=self.kernel, keep_prob=keep_prob, thd_ends=thd_ends, window=window)
        call["memo"] = self.seq_lengths_memo
        with self._dropout_rng(keep_prob):
            args = (self.cp_comm_type, query, key, value, self.cp_group)
            return context_parallel.attention(*args, **call)

    def _thd_ends(self, mask, params, t_local: int, where: str) -> tuple[int, ...]:
        """This rank's local padded cumulative ends (no leading 0) from Megatron's GLOBAL
        ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``), host ints."""
        cp_size = self.config.context_parallel_size
        padded = getattr(params, "cu_seqlens_q_padded", None)
        real = params.cu_seqlens_q
        padded = real if padded is None else padded
        memo = self.seq_lengths_memo
        ends = memo.context_parallel_ends(padded, cp_size)
        if mask.lengths.q != mask.lengths.kv:
            raise NotImplementedError(
                f"packed sequences with different query and key lengths under {where}; CP "
                "splits self-attention only. fix: context_parallel_size=1 for cross attention"
            )
        if not _cp_mask(mask.within, where)[0] and _has_padding(memo, real, padded):
            raise NotImplementedError(
                f"non-causal packed attention under {where} with padded sequences (real "
                "lengths < padded lengths): padding keys would be attended. fix: a causal "
                "layer, sequences without padding, or context_parallel_size=1"
            )
        if ends and ends[-1] > t_local:
            raise ValueError(
                f"packed_seq_params.cu_seqlens_q_padded: ends at {ends[-1] * cp_size} tokens, "
                f"but this CP rank holds {t_local} (x {cp_size} ranks); pass the GLOBAL padded "
                "offsets of the batch that get_thd_batch_on_this_cp_rank split"
            )
        if not ends or ends[-1] < t_local:  # a padding tail: one more sequence of its own
            ends = (*ends, t_local)
        return ends

    def _bias(self, attention_bias, query, seq_q, seq_kv, packed):
        """Megatron's ``attention_bias`` ``[b|1, np, sq|1, sk]`` (added after scaling) as the
        operator's ``pse`` (added before scaling)."""
        if attention_bias is None:
            return None
        if packed:
            raise NotImplementedError(
                "attention_bias with packed (thd) sequences is not supported by NPUFusionAttention;"
                " use unpacked (sbhd) batches for position biases"
            )
        batch, heads = query.shape[1], self.num_heads_per_partition
        shape = tuple(attention_bias.shape)
        accepted = [
            (batch, heads, seq_q, seq_kv),
            (1, heads, seq_q, seq_kv),
            (batch, heads, 1, seq_kv),
        ]
        if shape not in accepted:
            raise ValueError(
                f"attention_bias: shape {list(shape)} is not accepted; npu_fusion_attention takes "
                f"{' or '.join(str(list(a)) for a in accepted)} (heads per tensor-parallel rank)"
            )
        # Megatron's bias is post-scale (TE: softmax(scale * QK^T + bias)); the operator adds
        # pse before scaling (softmax(scale * (QK^T + pse))): divide by the scale once here.
        return (attention_bias / self.softmax_scale).to(query.dtype)

    def _dropout_rng(self, keep_prob: float):
        """Megatron runs attention dropout under the model-parallel RNG stream (not with SP)."""
        if keep_prob >= 1.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()


def _check_value_width(out: torch.Tensor, head_dim_v: int, heads: int, layout: str) -> None:
    """Refuse an output of D per head where Dv was due (an older torch_npu). out: SBH
    ``[s, b, heads * Dv]`` or TND ``[t, heads, Dv]``."""
    want = head_dim_v if layout == "TND" else heads * head_dim_v
    if out.shape[-1] != want:
        raise RuntimeError(
            f"npu_fusion_attention ({layout}) returned {out.shape[-1]} features where {want} "
            f"were due ({heads} heads of the value's {head_dim_v}): this torch_npu does not take "
            "a value head dim smaller than the query's (Dv < D, Multi-Latent Attention) "
            "unpadded; fix: mla_value_padding='auto' or 'on' (pads v to D), or a torch-npu / "
            "CANN release that does"
        )


def _has_padding(memo, real, padded) -> bool:
    """Whether the padded offsets differ from the real ones: causal attention over the padded layout
    is exact for real tokens, full attention would see the padding keys."""
    if real is None or padded is real:
        return False
    return memo.actual_seq_lengths(real) != memo.actual_seq_lengths(padded)


def _cp_mask(mask, where: str) -> tuple[bool, tuple[int, int] | None]:
    """``(causal, window)`` of a mask description that CP can split, else refuse."""
    if isinstance(mask, FullAttention):
        return False, None
    if isinstance(mask, (TopLeftCausalMask, BottomRightCausalMask)):
        return True, None
    if isinstance(mask, SlidingWindow):
        return mask.right == 0, (mask.left, mask.right)
    raise NotImplementedError(
        f"{type(mask).__name__} under {where}: only causal and full attention and sliding "
        "windows are split over CP ranks (a dense mask would be S x S per rank); fix: express "
        "padding by packing sequences, or use context_parallel_size=1"
    )


_INVARIANT_KERNEL = {"auto": "auto", "torch_npu": "flash_attn_npu", "reference": "reference"}
"""The attention's ``kernel`` -> batch_invariant_attention's: the Ascend kernel asked for by
name stays asked for by name (it raises rather than falls back)."""


def _invariant_causal(mask, packed: bool = False) -> bool:
    """Whether a mask description is causal (True) or none (False) for batch-invariant mode."""
    if isinstance(mask, FullAttention):
        return False
    if isinstance(mask, TopLeftCausalMask):
        return True
    if isinstance(mask, BottomRightCausalMask) and packed:  # a segment: its q and kv are equal
        return True
    raise ValueError(
        f"batch-invariant mode does not support the mask {type(mask).__name__}: use causal or no "
        "mask (verl's right padding is causal)"
    )


def _check_supported(config, kernel: str) -> None:
    check_kernel(kernel)
    softmax_type = getattr(config, "softmax_type", "vanilla")
    if softmax_type != "vanilla":
        raise NotImplementedError(
            f"softmax_type={softmax_type!r}: attention sinks are outside npu_fusion_attention's "
            "released contract; use softmax_type='vanilla'"
        )


def _tensor_parallel_size(kwargs) -> int:
    groups = kwargs.get("pg_collection")
    tp_group = getattr(groups, "tp", None)
    if tp_group is not None:
        return tp_group.size()
    return parallel_state.get_tensor_model_parallel_world_size()


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(
            f"num_attention_{what}: {total} is not divisible by the tensor-parallel size {parts}"
        )
    return total // parts


def _softmax_scale(softmax_scale, head_dim) -> float:
    """``1/sqrt(head_dim)`` unless Megatron passes a scale. Query-key layer scaling needs no term:
    its net scale is unchanged and the kernel computes the scores in fp32."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _layer_window(config, layer_number) -> tuple[int, int] | None:
    window = getattr(config, "window_size", None)
    if window is None:
        return None
    skip = getattr(config, "window_attn_skip_freq", None)
    if not is_layer_window_attention(window, skip, layer_number):
        return None
    return tuple(window)


class TELayoutNPUFusionAttention(EmptyExtraState, NPUFusionAttention):
    """``NPUFusionAttention`` with ``TEDotProductAttention``'s (empty) ``state_dict`` entry."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Empty, as ``TEDotProductAttention``'s without a learnable softmax offset."""
        return {}
