"""Mask descriptions: small frozen objects that answer the operator's mask arguments.

A description holds host-side metadata only (a window, segment boundaries), never an S x S
tensor; ``operator_args(device)`` gives ``atten_mask``, ``sparse_mode``, ``pre/next_tockens``
and, packed, ``actual_seq_qlen/kvlen``. ``to_dense`` and ``draw`` are for tests and bug reports.
Polarity: a mask is True where the score is **masked out**; ``draw`` prints kept positions as 1.
The exception is verl's ``[B, Skv]`` key-padding mask, True = real token (``key_padding``).
``describe_mask`` maps Megatron's arguments to a description (table: docs/masks.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mcore_npu.masks.compressed import compressed_causal_mask
from mcore_npu.masks.key_padding import check_key_padding, is_key_padding
from mcore_npu.masks.seqlens import SeqLengths, SeqLengthsMemo, actual_seq_lengths
from mcore_npu.ops.contract import INT32_MAX
from mcore_npu.ops.sparse_modes import band_keep, causal_keep


@dataclass(frozen=True, eq=False)
class OperatorMaskArgs:
    """Mask keyword arguments of one ``fusion_attention`` call (``atten_mask``: True = masked)."""

    atten_mask: torch.Tensor | None
    sparse_mode: int
    pre_tockens: int = INT32_MAX
    next_tockens: int = INT32_MAX
    actual_seq_qlen: tuple[int, ...] | None = None
    actual_seq_kvlen: tuple[int, ...] | None = None

    @property
    def input_layout(self) -> str:
        """``"TND"`` for packed batches; the caller picks the dense layout otherwise."""
        return "TND" if self.actual_seq_qlen is not None else ""

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``fusion_attention`` (lengths as host lists, as the op takes)."""
        kwargs: dict[str, Any] = {"atten_mask": self.atten_mask, "sparse_mode": self.sparse_mode}
        if (self.pre_tockens, self.next_tockens) != (INT32_MAX, INT32_MAX):
            kwargs.update(pre_tockens=self.pre_tockens, next_tockens=self.next_tockens)
        if self.actual_seq_qlen is not None:
            kwargs.update(
                actual_seq_qlen=list(self.actual_seq_qlen),
                actual_seq_kvlen=list(self.actual_seq_kvlen),
            )
        return kwargs


@dataclass(frozen=True)
class FullAttention:
    """Every query attends to every key. No mask tensor at all (0 bytes)."""

    def operator_args(self, device=None) -> OperatorMaskArgs:
        return OperatorMaskArgs(atten_mask=None, sparse_mode=0)

    def to_dense(self, seq_q: int, seq_kv: int, device=None) -> torch.Tensor:
        return torch.zeros(seq_q, seq_kv, dtype=torch.bool, device=device)


@dataclass(frozen=True)
class TopLeftCausalMask:
    """Causal from the top-left corner: keep ``j <= i``. Mode 2, the cached compressed mask."""

    def operator_args(self, device=None) -> OperatorMaskArgs:
        return OperatorMaskArgs(atten_mask=compressed_causal_mask(device), sparse_mode=2)

    def to_dense(self, seq_q: int, seq_kv: int, device=None) -> torch.Tensor:
        return ~causal_keep(seq_q, seq_kv, bottom_right=False, device=device)


@dataclass(frozen=True)
class BottomRightCausalMask:
    """Causal to the bottom-right corner: keep ``j <= i + Skv - Sq`` (FlashAttention's
    ``causal=True``). Mode 3, the cached compressed mask."""

    def operator_args(self, device=None) -> OperatorMaskArgs:
        return OperatorMaskArgs(atten_mask=compressed_causal_mask(device), sparse_mode=3)

    def to_dense(self, seq_q: int, seq_kv: int, device=None) -> torch.Tensor:
        return ~causal_keep(seq_q, seq_kv, bottom_right=True, device=device)


@dataclass(frozen=True)
class SlidingWindow:
    """Keep ``-left <= (j - i) - (Skv - Sq) <= right``: Megatron's ``window_size=(left, right)``.
    Mode 4 with ``pre_tockens=left``, ``next_tockens=right`` (-1, unbounded, becomes INT32_MAX)."""

    left: int
    right: int = 0

    def __post_init__(self) -> None:
        for name in ("left", "right"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise ValueError(
                    f"window_size: {name}={value!r} must be an int >= 0, or -1 for unbounded"
                )

    @property
    def pre_tockens(self) -> int:
        return INT32_MAX if self.left == -1 else self.left

    @property
    def next_tockens(self) -> int:
        return INT32_MAX if self.right == -1 else self.right

    def operator_args(self, device=None) -> OperatorMaskArgs:
        return OperatorMaskArgs(
            atten_mask=compressed_causal_mask(device),
            sparse_mode=4,
            pre_tockens=self.pre_tockens,
            next_tockens=self.next_tockens,
        )

    def to_dense(self, seq_q: int, seq_kv: int, device=None) -> torch.Tensor:
        tockens = (self.pre_tockens, self.next_tockens)
        return ~band_keep(seq_q, seq_kv, *tockens, offset=seq_kv - seq_q, device=device)


@dataclass(frozen=True, eq=False)
class ExplicitMask:
    """A dense bool mask from the caller (True = masked), passed through uncopied: mode 0. Shapes
    ``[B|1, 1|N, Sq, Skv]`` or ``[Sq, Skv]``; ``to_dense`` returns it in its own shape."""

    mask: torch.Tensor
    seq_q: int | None = None  # Sq of the call, when known: a [B,1,1,Skv] mask is fine at Sq = 1

    def __post_init__(self) -> None:
        check_explicit_mask(self.mask, self.seq_q)

    def operator_args(self, device=None) -> OperatorMaskArgs:
        return OperatorMaskArgs(atten_mask=self.mask, sparse_mode=0)

    def to_dense(self, seq_q: int, seq_kv: int, device=None) -> torch.Tensor:
        return self.mask.bool()


@dataclass(frozen=True)
class Packed:
    """A packed (THD) batch: each segment attends only to itself, under ``within`` (its mode);
    layout TND, ``actual_seq_qlen/kvlen`` from ``lengths`` (host tuples, no leading 0)."""

    lengths: SeqLengths
    within: FullAttention | BottomRightCausalMask | SlidingWindow = field(
        default_factory=BottomRightCausalMask
    )

    def operator_args(self, device=None) -> OperatorMaskArgs:
        inner = self.within.operator_args(device)
        return OperatorMaskArgs(
            atten_mask=inner.atten_mask,
            sparse_mode=inner.sparse_mode,
            pre_tockens=inner.pre_tockens,
            next_tockens=inner.next_tockens,
            actual_seq_qlen=self.lengths.q,
            actual_seq_kvlen=self.lengths.kv,
        )

    def to_dense(self, seq_q: int | None = None, seq_kv: int | None = None, device=None):
        """Block-diagonal ``[Tq, Tkv]`` mask (the sizes come from ``lengths``)."""
        mask = torch.ones(self.lengths.q[-1], self.lengths.kv[-1], dtype=torch.bool, device=device)
        q0 = k0 = 0
        for sq, skv in self.lengths.segments():
            mask[q0 : q0 + sq, k0 : k0 + skv] = self.within.to_dense(sq, skv, device)
            q0, k0 = q0 + sq, k0 + skv
        return mask


MaskDescription = (
    FullAttention
    | TopLeftCausalMask
    | BottomRightCausalMask
    | SlidingWindow
    | ExplicitMask
    | Packed
)


def check_explicit_mask(mask, seq_q: int | None = None) -> None:
    """Refuse, with the fix, dense masks the operator would refuse (True = masked out); a
    ``[B, 1, 1, Skv]`` padding mask is refused unless ``seq_q == 1`` (decoding)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention_mask: expected a bool tensor, got {type(mask).__name__}")
    if mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(
            f"attention_mask: dtype {mask.dtype} is not bool; pass a bool mask with "
            "True = masked out (Megatron's polarity), not an additive float mask"
        )
    if mask.dim() == 4 and mask.shape[2] == 1 and mask.shape[3] > 1 and seq_q != 1:
        raise ValueError(
            f"attention_mask: shape {list(mask.shape)} is a [B,1,1,S] padding mask, which "
            "npu_fusion_attention rejects; pass it through describe_mask (NPUFusionAttention "
            "does: it expands the rows once per mask tensor), expand it with "
            "mcore_npu.masks.build_npu_attention_mask(keep_mask), or pack the batch with "
            "mcore_npu.masks.padding_to_packed(keep_mask)"
        )
    if mask.dim() not in (2, 4):
        raise ValueError(
            f"attention_mask: shape {list(mask.shape)} is not [B|1, 1|N, Sq, Skv] or [Sq, Skv]"
        )


def draw(mask: torch.Tensor) -> str:
    """Render a 2-D mask (True = masked) as rows of 1 (kept) and 0 (masked), for bug reports."""
    return "\n".join(" ".join("0" if m else "1" for m in row) for row in mask.bool().tolist())


_CAUSAL_TYPES = frozenset({"causal", "padding_causal"})
_NEVER_LOOK_AHEAD = _CAUSAL_TYPES | {"causal_bottom_right"}
_FULL_TYPES = frozenset({"no_mask", "padding"})


def layer_window(kind: str, window_size: tuple[int, int] | None) -> SlidingWindow | None:
    """The window a layer really applies, or None when it restricts nothing. Causal layers refuse
    ``right > 0``; ``right = -1`` means 0, ``left = -1`` plain causal; ``(-1, -1)`` is no window."""
    if window_size is None:
        return None
    left, right = window_size
    if kind in _NEVER_LOOK_AHEAD:
        if right > 0:
            raise ValueError(
                f"window_size: ({left}, {right}) on a causal layer would let each query see "
                f"{right} later tokens; use ({left}, 0) for a causal sliding window"
            )
        return None if left == -1 else SlidingWindow(left, 0)
    return None if (left, right) == (-1, -1) else SlidingWindow(left, right)


def describe_mask(
    attn_mask_type,
    attention_mask: torch.Tensor | None,
    *,
    seq_q: int,
    seq_kv: int,
    batch: int | None = None,
    packed_seq_params=None,
    window_size: tuple[int, int] | None = None,
    memo: SeqLengthsMemo | None = None,
) -> MaskDescription:
    """Translate Megatron's core-attention inputs into a mask description.

    ``attention_mask``: bool, True = masked out, or None; or verl's ``[B, Skv]`` key-padding mask,
    **True = real token**, told from ``[Sq, Skv]`` by ``batch`` (None when packed). ``memo``: the
    per-tensor conversions (a throw-away one if None)."""
    kind = getattr(attn_mask_type, "name", attn_mask_type)
    memo = memo if memo is not None else SeqLengthsMemo()
    if kind != "no_mask" and is_key_padding(
        attention_mask, batch=batch, seq_q=seq_q, seq_kv=seq_kv, memo=memo
    ):  # verl's [B, S] mask, True = real token: right padding under causal attention
        check_key_padding(attention_mask, kind, seq_q=seq_q, seq_kv=seq_kv, memo=memo)
        attention_mask = None
    window = layer_window(kind, window_size)
    if window is not None and attention_mask is not None:
        raise ValueError(
            f"attention_mask: a dense mask together with window_size={tuple(window_size)} would "
            "lose one of them; pass attention_mask=None (a causal sliding window needs no mask; "
            "in Megatron's data pipeline: --no-create-attention-mask-in-dataloader), or fold the "
            "window into the mask yourself"
        )
    if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", "sbhd") == "thd":
        if attention_mask is not None:
            raise ValueError(
                "attention_mask: packed (thd) batches take no dense mask; segment boundaries "
                "come from packed_seq_params.cu_seqlens_*. Pass attention_mask=None."
            )
        if kind == "arbitrary":
            raise ValueError(
                "attention_mask: attn_mask_type=arbitrary needs a dense mask, which packed (thd) "
                "batches cannot take; use a causal or padding mask type with packed sequences"
            )
        within = window or (FullAttention() if kind in _FULL_TYPES else BottomRightCausalMask())
        return Packed(_packed_lengths(packed_seq_params, memo), within)
    if window is not None:
        return window
    if attention_mask is not None and kind != "no_mask":
        if _is_padding_rows_mask(attention_mask) and seq_q > 1:
            # [B,1,1,Skv] broadcasts over the query rows and replaces causal (as the local spec)
            attention_mask = memo.rows_expanded(attention_mask, seq_q)
        return ExplicitMask(attention_mask, seq_q)
    if kind in _CAUSAL_TYPES:
        return TopLeftCausalMask() if seq_q == seq_kv else BottomRightCausalMask()
    if kind == "causal_bottom_right":
        return BottomRightCausalMask()
    if kind in _FULL_TYPES:
        return FullAttention()
    raise ValueError(
        f"attention_mask: attn_mask_type={kind} needs an explicit bool mask (True = masked "
        "out), got None; pass attention_mask or use a causal / no_mask layer"
    )


def _is_padding_rows_mask(mask) -> bool:
    """A bool ``[B|1, 1, 1, Skv]`` (True = masked out): one key mask per batch entry."""
    return (
        isinstance(mask, torch.Tensor)
        and mask.dtype in (torch.bool, torch.uint8)
        and mask.dim() == 4
        and tuple(mask.shape[1:3]) == (1, 1)
    )


def _packed_lengths(params, memo: SeqLengthsMemo) -> SeqLengths:
    """Segment boundaries from PackedSeqParams; a ``_padded`` slot's padding tail becomes a
    segment of its own (``SeqLengths.with_padding``), so real tokens never see it."""
    if params.cu_seqlens_q is None and getattr(params, "cu_seqlens_q_padded", None) is None:
        raise ValueError("packed_seq_params: qkv_format='thd' needs cu_seqlens_q (leading 0)")
    real_q, slot_q = _side(params, "q", memo)
    real_kv, slot_kv = _side(params, "kv", memo)
    if real_kv is None:  # self-attention given the query side only
        real_kv, slot_kv = real_q, slot_q
    real = SeqLengths(real_q or slot_q, real_kv or slot_kv)
    padded = SeqLengths(slot_q or real.q, slot_kv or real.kv)
    return real.compact() if padded == real else SeqLengths.with_padding(real, padded)


def _side(params, side: str, memo: SeqLengthsMemo):
    """``(real ends, padded ends)`` of one side; either is None when its tensor is unset."""
    real = getattr(params, f"cu_seqlens_{side}", None)
    padded = getattr(params, f"cu_seqlens_{side}_padded", None)
    convert = memo.actual_seq_lengths
    return (None if real is None else convert(real)), (None if padded is None else convert(padded))


__all__ = [
    "BottomRightCausalMask",
    "ExplicitMask",
    "FullAttention",
    "MaskDescription",
    "OperatorMaskArgs",
    "Packed",
    "SlidingWindow",
    "TopLeftCausalMask",
    "actual_seq_lengths",
    "check_explicit_mask",
    "describe_mask",
    "draw",
]
