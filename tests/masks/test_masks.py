"""Issue 4, "Masks: lazily built, cached, never O(S^2) per step": ``mcore_npu.masks``.

Polarity: every *mask* here (the operator's ``atten_mask``, verl's and Megatron's masks, the
output of ``to_dense`` and ``build_npu_attention_mask``) is **True = masked out**. The hand-drawn
grids below are *keep* grids, as in the operator contract: 1 = kept, 0 = masked out
(``draw`` renders a mask the same way).

What is checked, and against what:

- ``to_dense`` of every description against hand-written grids (the contract's worked examples)
  and against the contract's keep-conditions (``tests.ops.oracle.keeps``, written independently).
- ``operator_args``: the reference operator called with a description's arguments equals the
  float64 oracle called with the description's dense mask (modes 0 and 1), dense layouts and TND.
- ``describe_mask``: the table in ``mcore_npu/masks/descriptions.py`` and its refusals.
- ``build_npu_attention_mask`` against verl's ``_build_npu_attn_mask`` (copied verbatim below).
- the compressed-mask cache, ``SeqLengthsMemo``, ``padding_to_packed``.
- memory, with the deterministic allocation tracker: 0 bytes per step once warm, no temporary
  larger than the mask when building.
"""

from __future__ import annotations

import sys
import textwrap
import types

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

import mcore_npu.masks.seqlens as seqlens_module
from mcore_npu.masks import (
    BottomRightCausalMask,
    CompressedMaskCache,
    ExplicitMask,
    FullAttention,
    Packed,
    SeqLengths,
    SeqLengthsMemo,
    SlidingWindow,
    TopLeftCausalMask,
    actual_seq_lengths,
    build_npu_attention_mask,
    compressed_causal_mask,
    describe_mask,
    draw,
    is_right_padded,
    normalize_device,
    padding_to_packed,
)
from mcore_npu.ops.reference import npu_fusion_attention
from mcore_npu.tools.bench.memory import track_allocations
from tests.launch import run_command
from tests.ops.oracle import keeps, oracle

INT32_MAX = 2147483647
MiB = 2**20
KiB = 2**10
HEADS = 2
HEAD_DIM = 4
SCALE = 0.5
ATOL = 1e-9  # float64 reference vs float64 oracle


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _verl_build_npu_attn_mask(original_attention_mask):
    """verl-project/verl ``verl/models/mcore/util.py::_build_npu_attn_mask`` (after PR 7055),
    verbatim. ``[B, S]`` keep mask (True = real token) -> ``[B, 1, S, S]`` bool, True = masked."""
    # fmt: off
    _, seq_len = original_attention_mask.shape
    causal_mask = torch.tril(torch.ones(seq_len, seq_len, device=original_attention_mask.device, dtype=torch.bool))
    attn_mask = original_attention_mask.unsqueeze(-1) & original_attention_mask.unsqueeze(-2)
    attn_mask = attn_mask & causal_mask
    return (~attn_mask).unsqueeze(1).contiguous()
    # fmt: on


def _grid(text: str) -> str:
    """A hand-drawn keep grid (1 = kept), normalised to what ``draw`` prints."""
    return "\n".join(" ".join(line.split()) for line in textwrap.dedent(text).strip().splitlines())


def _to_layout(bnsd: torch.Tensor, layout: str) -> torch.Tensor:
    """``[B, N, S, D]`` -> the same values in ``layout`` (BSH, SBH, BSND or BNSD)."""
    if layout == "BSH":  # [B, N, S, D] -> [B, S, N*D]
        return bnsd.transpose(1, 2).flatten(2).contiguous()
    if layout == "SBH":  # [B, N, S, D] -> [S, B, N*D]
        return bnsd.permute(2, 0, 1, 3).flatten(2).contiguous()
    if layout == "BSND":  # [B, N, S, D] -> [B, S, N, D]
        return bnsd.transpose(1, 2).contiguous()
    return bnsd.contiguous()


def _qkv(shape_q, shape_kv, seed):
    """float64 query ``shape_q`` and key/value ``shape_kv`` from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=gen, dtype=torch.float64)
    k = torch.randn(*shape_kv, generator=gen, dtype=torch.float64)
    v = torch.randn(*shape_kv, generator=gen, dtype=torch.float64)
    return q, k, v


def _assert_valid_rows_close(got, want, valid):
    """Compare only rows that keep at least one key (the contract's rule for invalid rows)."""
    assert got.shape == want.shape
    assert valid.any(), "the case has no valid row: it would test nothing"
    err = (got.double()[valid] - want[valid]).abs().max().item()
    assert err <= ATOL, f"max error on valid rows {err:.3e} > {ATOL:.0e}"


def _keep_masks(padding: str, batch: int, seq: int, seed: int) -> torch.Tensor:
    """A ``[B, S]`` bool keep mask (True = real token) with the named padding pattern.

    right: ``1 1 1 0 0``; left: ``0 0 1 1 1``; mixed: random bits; all_pad: row 0 all padding,
    the others right-padded.
    """
    gen = torch.Generator().manual_seed(seed)
    if padding == "mixed":
        return torch.rand(batch, seq, generator=gen) < 0.6
    lengths = torch.randint(0, seq + 1, (batch,), generator=gen)
    if batch > 1:
        lengths[0] = seq  # one full row among several
    if padding == "all_pad":
        lengths[0] = 0
    keep = torch.arange(seq).unsqueeze(0) < lengths.unsqueeze(1)  # right-padded
    return keep.flip(1) if padding == "left" else keep


# --------------------------------------------------------------------------------------------
# to_dense against hand-written grids and the contract's keep-conditions
# --------------------------------------------------------------------------------------------

HAND_GRIDS = [
    pytest.param(TopLeftCausalMask(), 3, 4, "1 0 0 0\n1 1 0 0\n1 1 1 0", id="mode2-3x4"),
    pytest.param(BottomRightCausalMask(), 3, 4, "1 1 0 0\n1 1 1 0\n1 1 1 1", id="mode3-3x4"),
    pytest.param(TopLeftCausalMask(), 4, 3, "1 0 0\n1 1 0\n1 1 1\n1 1 1", id="mode2-4x3"),
    pytest.param(BottomRightCausalMask(), 4, 3, "0 0 0\n1 0 0\n1 1 0\n1 1 1", id="mode3-4x3"),
    pytest.param(
        SlidingWindow(2, 0),
        5,
        5,
        """
        1 0 0 0 0
        1 1 0 0 0
        1 1 1 0 0
        0 1 1 1 0
        0 0 1 1 1
        """,
        id="mode4-5x5-pre2-next0",
    ),  # fmt: skip
    pytest.param(
        SlidingWindow(-1, 0), 4, 4, "1 0 0 0\n1 1 0 0\n1 1 1 0\n1 1 1 1", id="window-unbounded-left"
    ),
    pytest.param(
        SlidingWindow(1, -1),
        4,
        4,
        "1 1 1 1\n1 1 1 1\n0 1 1 1\n0 0 1 1",
        id="window-unbounded-right",
    ),
    pytest.param(SlidingWindow(-1, -1), 2, 3, "1 1 1\n1 1 1", id="window-unbounded-both"),
    pytest.param(SlidingWindow(1, 0), 2, 4, "0 1 1 0\n0 0 1 1", id="window-2x4-bottom-right"),
    pytest.param(SlidingWindow(0, 1), 3, 3, "1 1 0\n0 1 1\n0 0 1", id="window-left0-right1"),
    pytest.param(FullAttention(), 2, 3, "1 1 1\n1 1 1", id="full"),
]


@pytest.mark.parametrize(("desc", "seq_q", "seq_kv", "keep_grid"), HAND_GRIDS)
def test_to_dense_matches_the_contracts_grids(desc, seq_q, seq_kv, keep_grid):
    mask = desc.to_dense(seq_q, seq_kv)  # True = masked out
    assert mask.dtype == torch.bool and mask.shape == (seq_q, seq_kv)
    assert draw(mask) == _grid(keep_grid)


PACKED_GRIDS = [
    pytest.param(
        Packed(SeqLengths.from_lengths([2, 3])),
        """
        1 0 0 0 0
        1 1 0 0 0
        0 0 1 0 0
        0 0 1 1 0
        0 0 1 1 1
        """,
        id="causal-2-3",
    ),
    pytest.param(
        Packed(SeqLengths.from_lengths([2, 0, 2]), FullAttention()),
        "1 1 0 0\n1 1 0 0\n0 0 1 1\n0 0 1 1",
        id="full-with-empty-segment",
    ),
    pytest.param(
        Packed(SeqLengths.from_lengths([1, 2], [3, 2]), BottomRightCausalMask()),
        "1 1 1 0 0\n0 0 0 1 0\n0 0 0 1 1",
        id="causal-q-shorter-than-kv",
    ),
    pytest.param(
        Packed(SeqLengths.from_lengths([3, 2]), SlidingWindow(1, 0)),
        """
        1 0 0 0 0
        1 1 0 0 0
        0 1 1 0 0
        0 0 0 1 0
        0 0 0 1 1
        """,
        id="window-1-0",
    ),
]


@pytest.mark.parametrize(("desc", "keep_grid"), PACKED_GRIDS)
def test_packed_to_dense_is_block_diagonal(desc, keep_grid):
    mask = desc.to_dense()
    assert mask.dtype == torch.bool
    assert draw(mask) == _grid(keep_grid)


def test_explicit_mask_to_dense_is_the_callers_mask_as_bool():
    mask = torch.tensor([[0, 1], [1, 0]], dtype=torch.uint8)
    dense = ExplicitMask(mask).to_dense(2, 2)
    assert dense.dtype == torch.bool
    assert torch.equal(dense, mask.bool())


def _contract_keep(mode, seq_q, seq_kv, pre=INT32_MAX, nxt=INT32_MAX) -> torch.Tensor:
    """Keep grid (True = kept) from the contract's per-mode condition, pair by pair."""
    rows = [
        [keeps(mode, i, j, seq_q, seq_kv, pre, nxt, None, None, False) for j in range(seq_kv)]
        for i in range(seq_q)
    ]
    return torch.tensor(rows, dtype=torch.bool).reshape(seq_q, seq_kv)


SIZES = [(1, 1), (1, 6), (6, 1), (3, 4), (4, 3), (5, 5), (2, 9), (9, 2)]
WINDOWS = [(0, 0), (2, 0), (0, 2), (3, 1), (-1, 0), (2, -1), (-1, -1), (20, 20)]


@pytest.mark.parametrize(("seq_q", "seq_kv"), SIZES)
def test_causal_to_dense_follows_modes_2_and_3(seq_q, seq_kv):
    assert torch.equal(
        ~TopLeftCausalMask().to_dense(seq_q, seq_kv), _contract_keep(2, seq_q, seq_kv)
    )
    assert torch.equal(
        ~BottomRightCausalMask().to_dense(seq_q, seq_kv), _contract_keep(3, seq_q, seq_kv)
    )
    assert not FullAttention().to_dense(seq_q, seq_kv).any()


@pytest.mark.parametrize(("seq_q", "seq_kv"), SIZES)
@pytest.mark.parametrize(("left", "right"), WINDOWS)
def test_window_to_dense_follows_mode_4(left, right, seq_q, seq_kv):
    pre = INT32_MAX if left == -1 else left
    nxt = INT32_MAX if right == -1 else right
    got = ~SlidingWindow(left, right).to_dense(seq_q, seq_kv)
    assert torch.equal(got, _contract_keep(4, seq_q, seq_kv, pre, nxt))


# --------------------------------------------------------------------------------------------
# operator_args: what each description hands to the operator
# --------------------------------------------------------------------------------------------


def test_operator_args_of_causal_masks_use_the_cached_compressed_mask():
    for desc, mode in ((TopLeftCausalMask(), 2), (BottomRightCausalMask(), 3)):
        args = desc.operator_args()
        assert args.sparse_mode == mode
        assert args.atten_mask is compressed_causal_mask()
        assert args.as_kwargs() == {"atten_mask": args.atten_mask, "sparse_mode": mode}
        assert args.actual_seq_qlen is None and args.input_layout == ""


@pytest.mark.parametrize(
    ("left", "right", "pre", "nxt"),
    [(3, 0, 3, 0), (0, 2, 0, 2), (-1, 0, INT32_MAX, 0), (4, -1, 4, INT32_MAX)],
)
def test_operator_args_of_a_window_are_mode_4_with_pre_and_next(left, right, pre, nxt):
    args = SlidingWindow(left, right).operator_args()
    assert (args.sparse_mode, args.pre_tockens, args.next_tockens) == (4, pre, nxt)
    assert args.atten_mask is compressed_causal_mask()
    kwargs = args.as_kwargs()
    assert (kwargs["pre_tockens"], kwargs["next_tockens"]) == (pre, nxt)


def test_operator_args_of_full_attention_carry_no_tensor():
    args = FullAttention().operator_args()
    assert args.atten_mask is None and args.sparse_mode == 0
    assert args.as_kwargs() == {"atten_mask": None, "sparse_mode": 0}


def test_operator_args_of_an_explicit_mask_are_the_callers_tensor_not_a_copy():
    mask = torch.zeros(2, 1, 3, 3, dtype=torch.bool)
    args = ExplicitMask(mask).operator_args()
    assert args.atten_mask is mask
    assert args.as_kwargs()["atten_mask"] is mask
    assert args.sparse_mode == 0


def test_operator_args_of_packed_are_ends_without_the_leading_zero():
    cu_seqlens = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    desc = Packed(SeqLengths(actual_seq_lengths(cu_seqlens), actual_seq_lengths(cu_seqlens)))
    args = desc.operator_args()
    assert args.actual_seq_qlen == (2, 2, 5) and args.actual_seq_kvlen == (2, 2, 5)
    assert args.sparse_mode == 3 and args.atten_mask is compressed_causal_mask()
    assert args.input_layout == "TND"
    kwargs = args.as_kwargs()
    assert kwargs["actual_seq_qlen"] == [2, 2, 5] and kwargs["actual_seq_kvlen"] == [2, 2, 5]
    assert all(type(x) is int for x in kwargs["actual_seq_qlen"])


def test_operator_args_of_packed_windows_and_full_attention():
    lengths = SeqLengths.from_lengths([3, 4])
    window = Packed(lengths, SlidingWindow(2, 0)).operator_args()
    assert (window.sparse_mode, window.pre_tockens, window.next_tockens) == (4, 2, 0)
    full = Packed(lengths, FullAttention()).operator_args()
    assert full.atten_mask is None and full.sparse_mode == 0
    assert full.actual_seq_qlen == (3, 7)


# --------------------------------------------------------------------------------------------
# operator_args through the reference operator == the oracle with the dense mask
# --------------------------------------------------------------------------------------------

DENSE_DESCRIPTIONS = [
    pytest.param(FullAttention(), id="full"),
    pytest.param(TopLeftCausalMask(), id="top-left"),
    pytest.param(BottomRightCausalMask(), id="bottom-right"),
    pytest.param(SlidingWindow(2, 0), id="window-2-0"),
    pytest.param(SlidingWindow(1, 2), id="window-1-2"),
    pytest.param(SlidingWindow(-1, 1), id="window-unbounded-left"),
    pytest.param("explicit-2d", id="explicit-2d"),
    pytest.param("explicit-b1", id="explicit-b1ss"),
]


def _description(desc, batch, seq_q, seq_kv):
    """Builds the explicit masks (they depend on the shape); the others are used as given."""
    if not isinstance(desc, str):
        return desc
    gen = torch.Generator().manual_seed(seq_q * 31 + seq_kv)
    shape = (seq_q, seq_kv) if desc == "explicit-2d" else (batch, 1, seq_q, seq_kv)
    mask = torch.rand(*shape, generator=gen) < 0.4  # True = masked out
    return ExplicitMask(mask)


@pytest.mark.parametrize("desc", DENSE_DESCRIPTIONS)
@pytest.mark.parametrize(("seq_q", "seq_kv"), [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
@pytest.mark.parametrize("dense_mode", [0, 1])
def test_reference_with_operator_args_equals_oracle_with_dense_mask(
    desc, seq_q, seq_kv, layout, dense_mode
):
    batch = 2
    desc = _description(desc, batch, seq_q, seq_kv)
    q, k, v = (
        _to_layout(t, layout)
        for t in _qkv((batch, HEADS, seq_q, HEAD_DIM), (batch, HEADS, seq_kv, HEAD_DIM), seq_q)
    )
    got = npu_fusion_attention(
        q, k, v, HEADS, layout, scale=SCALE, **desc.operator_args().as_kwargs()
    )[0]
    dense = desc.to_dense(seq_q, seq_kv)  # True = masked out
    want, valid = oracle(
        q, k, v, HEADS, layout, atten_mask=dense, scale=SCALE, sparse_mode=dense_mode
    )
    _assert_valid_rows_close(got, want, valid)
    assert torch.all(got[~valid] == 0), "rows with no kept key must be 0"


PACKED_DESCRIPTIONS = [
    pytest.param([2, 3], None, BottomRightCausalMask(), id="causal"),
    pytest.param([3, 1, 4], None, FullAttention(), id="full"),
    pytest.param([3, 0, 2], None, BottomRightCausalMask(), id="causal-empty-middle"),
    pytest.param([1, 2], [3, 2], BottomRightCausalMask(), id="causal-q-shorter"),
    pytest.param([3, 2], [1, 2], BottomRightCausalMask(), id="causal-q-longer"),
    pytest.param([4, 3], None, SlidingWindow(1, 0), id="window-1-0"),
    pytest.param([2, 4], [4, 3], SlidingWindow(-1, 1), id="window-unbounded-left"),
]


@pytest.mark.parametrize(("q_lengths", "kv_lengths", "within"), PACKED_DESCRIPTIONS)
def test_packed_through_tnd_equals_oracle_with_block_diagonal_mask(q_lengths, kv_lengths, within):
    desc = Packed(SeqLengths.from_lengths(q_lengths, kv_lengths), within)
    total_q, total_kv = desc.lengths.q[-1], desc.lengths.kv[-1]
    q, k, v = _qkv((total_q, HEADS, HEAD_DIM), (total_kv, HEADS, HEAD_DIM), total_q)  # TND
    args = desc.operator_args()
    got = npu_fusion_attention(q, k, v, HEADS, args.input_layout, scale=SCALE, **args.as_kwargs())[
        0
    ]
    # The packed batch as one BSND sequence (B = 1) under the block-diagonal dense mask.
    want, valid = oracle(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), HEADS, "BSND",
        atten_mask=desc.to_dense(), scale=SCALE, sparse_mode=1,
    )  # fmt: skip
    _assert_valid_rows_close(got, want[0], valid[0])


# --------------------------------------------------------------------------------------------
# describe_mask: Megatron's inputs -> a description
# --------------------------------------------------------------------------------------------

CAUSAL_KINDS = [AttnMaskType.causal, AttnMaskType.padding_causal]
FULL_KINDS = [AttnMaskType.no_mask, AttnMaskType.padding]


@pytest.mark.parametrize("kind", list(AttnMaskType))
def test_describe_a_window_wins_over_the_mask_type(kind):
    desc = describe_mask(kind, None, seq_q=4, seq_kv=4, window_size=(3, 0))
    assert desc == SlidingWindow(3, 0)


@pytest.mark.parametrize("kind", list(AttnMaskType))
def test_describe_refuses_a_dense_mask_together_with_a_window(kind):
    with pytest.raises(ValueError, match="attention_mask: a dense mask together with window_size"):
        describe_mask(kind, torch.zeros(4, 4, dtype=torch.bool), seq_q=4, seq_kv=4,
                      window_size=(3, 0))  # fmt: skip


@pytest.mark.parametrize(
    "kind", [AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right]
)
def test_causal_layers_never_look_ahead_through_a_window(kind):
    with pytest.raises(ValueError, match=r"window_size: \(2, 1\) on a causal layer"):
        describe_mask(kind, None, seq_q=4, seq_kv=4, window_size=(2, 1))
    assert describe_mask(kind, None, seq_q=4, seq_kv=4, window_size=(2, -1)) == SlidingWindow(2, 0)
    plain = describe_mask(kind, None, seq_q=4, seq_kv=4)
    assert describe_mask(kind, None, seq_q=4, seq_kv=4, window_size=(-1, 0)) == plain
    assert describe_mask(kind, None, seq_q=4, seq_kv=4, window_size=(-1, -1)) == plain


def test_non_causal_window_keeps_both_sides():
    desc = describe_mask(AttnMaskType.no_mask, None, seq_q=4, seq_kv=4, window_size=(1, 2))
    assert desc == SlidingWindow(1, 2)
    assert describe_mask(AttnMaskType.no_mask, None, seq_q=4, seq_kv=4,
                         window_size=(-1, -1)) == FullAttention()  # fmt: skip


def test_a_one_row_decode_mask_is_accepted():
    mask = torch.zeros(2, 1, 1, 6, dtype=torch.bool)  # Sq = 1: [B, 1, 1, Skv] is [B, 1, Sq, Skv]
    desc = describe_mask(AttnMaskType.padding, mask, seq_q=1, seq_kv=6)
    assert desc.operator_args().atten_mask is mask


@pytest.mark.parametrize("kind", [k for k in AttnMaskType if k is not AttnMaskType.no_mask])
def test_describe_a_mask_tensor_becomes_an_explicit_mask(kind):
    mask = torch.zeros(2, 1, 4, 4, dtype=torch.bool)
    desc = describe_mask(kind, mask, seq_q=4, seq_kv=4)
    assert isinstance(desc, ExplicitMask) and desc.mask is mask


def test_describe_no_mask_ignores_a_mask_tensor():
    mask = torch.ones(4, 4, dtype=torch.bool)
    assert describe_mask(AttnMaskType.no_mask, mask, seq_q=4, seq_kv=4) == FullAttention()


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_describe_causal_is_top_left_when_square_else_bottom_right(kind):
    assert describe_mask(kind, None, seq_q=4, seq_kv=4) == TopLeftCausalMask()
    assert describe_mask(kind, None, seq_q=2, seq_kv=4) == BottomRightCausalMask()


def test_describe_causal_bottom_right_and_full_kinds():
    for seq_q in (4, 2):
        desc = describe_mask(AttnMaskType.causal_bottom_right, None, seq_q=seq_q, seq_kv=4)
        assert desc == BottomRightCausalMask()
    for kind in FULL_KINDS:
        assert describe_mask(kind, None, seq_q=3, seq_kv=4) == FullAttention()


def test_describe_accepts_the_enum_name_as_a_string():
    assert describe_mask("causal", None, seq_q=3, seq_kv=3) == TopLeftCausalMask()


def test_describe_sbhd_packed_seq_params_are_dense():
    params = PackedSeqParams(qkv_format="sbhd")
    desc = describe_mask(AttnMaskType.causal, None, seq_q=3, seq_kv=3, packed_seq_params=params)
    assert desc == TopLeftCausalMask()


def _thd(cu_q, cu_kv=None, cu_q_padded=None, cu_kv_padded=None) -> PackedSeqParams:
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_q if cu_kv is None else cu_kv,
        cu_seqlens_q_padded=cu_q_padded,
        cu_seqlens_kv_padded=cu_kv_padded,
    )


def _cu(*ends) -> torch.Tensor:
    return torch.tensor([0, *ends], dtype=torch.int32)


@pytest.mark.parametrize(
    ("kind", "within"),
    [
        (AttnMaskType.causal, BottomRightCausalMask()),
        (AttnMaskType.padding_causal, BottomRightCausalMask()),
        (AttnMaskType.causal_bottom_right, BottomRightCausalMask()),
        (AttnMaskType.no_mask, FullAttention()),
        (AttnMaskType.padding, FullAttention()),
    ],
)
def test_describe_thd_is_packed(kind, within):
    params = _thd(_cu(3, 5))
    desc = describe_mask(kind, None, seq_q=5, seq_kv=5, packed_seq_params=params)
    assert desc == Packed(SeqLengths((3, 5), (3, 5)), within)


def test_describe_thd_with_a_window_is_a_packed_window():
    params = _thd(_cu(3, 5))
    desc = describe_mask(
        AttnMaskType.causal, None, seq_q=5, seq_kv=5, packed_seq_params=params, window_size=(2, 0)
    )
    assert desc == Packed(SeqLengths((3, 5), (3, 5)), SlidingWindow(2, 0))


def test_describe_thd_splits_padding_tails_into_their_own_segments():
    # q: slots of 4 and 4 tokens hold 3 and 2 real ones; kv: slots of 6 and 2 hold 2 and 2
    params = _thd(_cu(3, 5), _cu(2, 4), cu_q_padded=_cu(4, 8), cu_kv_padded=_cu(6, 8))
    desc = describe_mask(AttnMaskType.no_mask, None, seq_q=8, seq_kv=8, packed_seq_params=params)
    assert desc.lengths == SeqLengths((3, 4, 6, 8), (2, 6, 8, 8))
    dense = desc.to_dense()  # True = masked out
    real_q, pad_kv = [0, 1, 2, 4, 5], [2, 3, 4, 5]
    assert dense[real_q][:, pad_kv].all()  # no real query sees a padding key
    only_q_padded = _thd(_cu(3, 5), _cu(2, 4), cu_q_padded=_cu(4, 8))
    desc = describe_mask(
        AttnMaskType.causal, None, seq_q=8, seq_kv=4, packed_seq_params=only_q_padded
    )
    assert desc.lengths == SeqLengths((3, 4, 6, 8), (2, 2, 4, 4))


def test_describe_thd_refuses_arbitrary_without_a_dense_mask():
    with pytest.raises(ValueError, match="attention_mask: attn_mask_type=arbitrary"):
        describe_mask(AttnMaskType.arbitrary, None, seq_q=5, seq_kv=5,
                      packed_seq_params=_thd(_cu(3, 5)))  # fmt: skip


def test_padding_to_packed_gives_all_padding_rows_no_segment():
    batch = padding_to_packed(torch.tensor([[0, 0, 0], [1, 1, 0]]))
    assert batch.cu_seqlens.tolist() == [0, 0, 2] and batch.lengths.q == (2,)


def test_describe_thd_converts_each_cu_seqlens_tensor_once_per_memo():
    memo = SeqLengthsMemo()
    params = _thd(_cu(3, 5))  # cu_seqlens_kv is cu_seqlens_q
    for _ in range(4):  # four layers
        describe_mask(
            AttnMaskType.causal, None, seq_q=5, seq_kv=5, packed_seq_params=params, memo=memo
        )
    assert memo.conversions == 1
    other = _thd(_cu(3, 5), _cu(1, 5))
    describe_mask(AttnMaskType.causal, None, seq_q=5, seq_kv=5, packed_seq_params=other, memo=memo)
    assert memo.conversions == 3


@pytest.mark.parametrize("batch", [2, 1])
def test_describe_expands_a_b11s_padding_mask_once_per_mask_tensor(batch):
    mask = torch.zeros(batch, 1, 1, 4, dtype=torch.bool)  # True = masked out
    mask[0, ..., 3] = True
    memo = SeqLengthsMemo()
    first = describe_mask(AttnMaskType.causal, mask, seq_q=4, seq_kv=4, memo=memo)
    again = describe_mask(AttnMaskType.causal, mask, seq_q=4, seq_kv=4, memo=memo)
    assert isinstance(first, ExplicitMask) and first.mask is again.mask and memo.expansions == 1
    assert first.mask.shape == (batch, 1, 4, 4)
    assert torch.equal(first.mask, mask.expand(batch, 1, 4, 4))  # every query row, no causal
    mask[0, ..., 0] = True  # refilled in place: expanded afresh
    refreshed = describe_mask(AttnMaskType.causal, mask, seq_q=4, seq_kv=4, memo=memo)
    assert memo.expansions == 2 and bool(refreshed.mask[0, 0, 2, 0])


def test_explicit_mask_itself_refuses_a_b11s_mask_naming_the_ways_out():
    mask = torch.zeros(2, 1, 1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"attention_mask: shape \[2, 1, 1, 4\].*describe_mask"):
        ExplicitMask(mask, seq_q=4)


def test_describe_refuses_a_float_b11s_mask():
    with pytest.raises(TypeError, match="attention_mask: dtype torch.float32"):
        describe_mask(AttnMaskType.padding, torch.zeros(2, 1, 1, 4), seq_q=4, seq_kv=4)


def test_describe_refuses_a_float_mask():
    mask = torch.zeros(4, 4)
    with pytest.raises(TypeError, match="attention_mask: dtype torch.float32"):
        describe_mask(AttnMaskType.arbitrary, mask, seq_q=4, seq_kv=4)


def test_describe_refuses_an_explicit_mask_with_thd():
    mask = torch.zeros(5, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="attention_mask: packed"):
        describe_mask(AttnMaskType.causal, mask, seq_q=5, seq_kv=5, packed_seq_params=_thd(_cu(5)))


def test_describe_refuses_arbitrary_without_a_mask():
    with pytest.raises(ValueError, match="attention_mask: attn_mask_type=arbitrary"):
        describe_mask(AttnMaskType.arbitrary, None, seq_q=4, seq_kv=4)


def test_describe_refuses_thd_without_cu_seqlens():
    params = PackedSeqParams(qkv_format="thd")
    with pytest.raises(ValueError, match="packed_seq_params"):
        describe_mask(AttnMaskType.causal, None, seq_q=4, seq_kv=4, packed_seq_params=params)


def test_explicit_mask_refuses_what_the_operator_refuses():
    with pytest.raises(TypeError, match="attention_mask"):
        ExplicitMask([[True]])
    with pytest.raises(ValueError, match=r"attention_mask: shape \[4\]"):
        ExplicitMask(torch.zeros(4, dtype=torch.bool))


# --------------------------------------------------------------------------------------------
# build_npu_attention_mask == verl's _build_npu_attn_mask
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["left", "right", "mixed", "all_pad"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("seq", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_build_npu_attention_mask_equals_verl(padding, batch, seq, dtype):
    keep = _keep_masks(padding, batch, seq, seed=batch * 100 + seq)
    got = build_npu_attention_mask(keep.to(dtype))
    want = _verl_build_npu_attn_mask(keep)  # verl on the .bool() of the input
    assert got.dtype == torch.bool and got.shape == (batch, 1, seq, seq)
    assert torch.equal(got, want)


def test_build_npu_attention_mask_example_grid():
    mask = build_npu_attention_mask(torch.tensor([[1, 1, 0]]))[0, 0]
    assert draw(mask) == _grid("1 0 0\n1 1 0\n0 0 0")


def test_build_npu_attention_mask_refuses_bad_input():
    with pytest.raises(ValueError, match="keep_mask"):
        build_npu_attention_mask(torch.ones(2, 1, 4, dtype=torch.bool))
    for dtype in (torch.float32, torch.bfloat16, torch.complex64):
        with pytest.raises(TypeError, match=r"keep_mask: dtype .* bool .* integer"):
            build_npu_attention_mask(torch.ones(2, 4, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_build_npu_attention_mask_integer_dtypes_and_diagonal(dtype):
    keep = _keep_masks("right", 3, 7, seed=5)
    got = build_npu_attention_mask(keep.to(dtype))
    assert torch.equal(got, _verl_build_npu_attn_mask(keep))
    assert torch.equal(~got.diagonal(dim1=-2, dim2=-1).squeeze(1), keep)


# --------------------------------------------------------------------------------------------
# the compressed-mask cache
# --------------------------------------------------------------------------------------------


def test_cache_returns_the_same_object_and_the_contracts_content():
    cache = CompressedMaskCache()
    first = cache.get("causal")
    assert cache.get("causal") is first
    assert cache.get("causal", "cpu") is first and cache.get("causal", torch.device("cpu")) is first
    assert first.dtype == torch.bool and first.shape == (2048, 2048)
    assert torch.equal(first, torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1))
    assert compressed_causal_mask() is compressed_causal_mask("cpu")


def test_cache_prefix_mask_content():
    prefix = CompressedMaskCache().get("prefix")
    assert prefix.dtype == torch.bool and prefix.shape == (3072, 2048)
    assert torch.equal(prefix[:2048], torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))
    assert not prefix[2048:, :1024].any() and prefix[2048:, 1024:].all()


def test_cache_size_and_clear():
    cache = CompressedMaskCache()
    assert (len(cache), cache.nbytes) == (0, 0)
    causal = cache.get("causal")
    assert (len(cache), cache.nbytes) == (1, 4 * MiB)
    cache.get("prefix")
    assert (len(cache), cache.nbytes) == (2, 10 * MiB)
    cache.clear()
    assert (len(cache), cache.nbytes) == (0, 0)
    rebuilt = cache.get("causal")
    assert rebuilt is not causal and torch.equal(rebuilt, causal)
    prefix_only = CompressedMaskCache()
    prefix_only.get("prefix")
    assert prefix_only.nbytes == 6 * MiB


def test_cache_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="kind: unknown compressed mask 'band'"):
        CompressedMaskCache().get("band")


@pytest.mark.parametrize(("kind", "mask_bytes"), [("causal", 4 * MiB), ("prefix", 6 * MiB)])
def test_cache_first_build_allocates_no_temporary_larger_than_the_mask(kind, mask_bytes):
    cache = CompressedMaskCache()
    with track_allocations() as usage:
        cache.get(kind)
    assert mask_bytes <= usage.peak_bytes <= mask_bytes + 64 * KiB


def test_normalize_device_cpu(monkeypatch):
    no_accelerator = types.SimpleNamespace(is_available=lambda: False)
    monkeypatch.setattr(torch, "accelerator", no_accelerator)
    assert normalize_device(None) == torch.device("cpu")
    assert normalize_device("cpu") == torch.device("cpu")
    assert normalize_device(torch.device("cpu")) == torch.device("cpu")


def test_normalize_device_fills_the_index_from_the_device_namespace(monkeypatch):
    # "npu" is not a device type without torch_npu (see the subprocess test below); "xpu" is a
    # built-in type, and index filling reads torch.<type>.current_device() the same way.
    monkeypatch.setattr(torch, "xpu", types.SimpleNamespace(current_device=lambda: 2))
    assert normalize_device("xpu") == torch.device("xpu", 2) == normalize_device("xpu:2")
    assert normalize_device("xpu:1") == torch.device("xpu", 1)
    accelerator = types.SimpleNamespace(
        is_available=lambda: True, current_accelerator=lambda: torch.device("xpu")
    )
    monkeypatch.setattr(torch, "accelerator", accelerator)
    assert normalize_device(None) == torch.device("xpu", 2)


def test_normalize_device_npu_with_a_stand_in_torch_npu_namespace():
    # torch.device("npu") needs torch_npu's rename of the PrivateUse1 backend, which cannot be
    # undone, so it runs in a child interpreter: rename, install a stand-in torch.npu, compare.
    script = textwrap.dedent(
        """
        import types, torch
        torch.utils.rename_privateuse1_backend("npu")
        torch.npu = types.SimpleNamespace(current_device=lambda: 0)
        from mcore_npu.masks import CompressedMaskCache, normalize_device
        assert normalize_device("npu") == normalize_device("npu:0") == torch.device("npu", 0)
        assert normalize_device("npu:1") == torch.device("npu", 1)
        torch.npu = types.SimpleNamespace(current_device=lambda: 3)
        assert normalize_device("npu") == torch.device("npu", 3)
        print("ok")
        """
    )
    done = run_command([sys.executable, "-c", script])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# --------------------------------------------------------------------------------------------
# SeqLengthsMemo and actual_seq_lengths
# --------------------------------------------------------------------------------------------


def test_actual_seq_lengths_drops_the_leading_zero():
    ends = actual_seq_lengths(torch.tensor([0, 3, 3, 5], dtype=torch.int32))
    assert ends == (3, 3, 5) and all(type(x) is int for x in ends)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (torch.tensor([2, 4]), ValueError, r"cu_seqlens: \[2, 4\] does not start with 0"),
        (torch.tensor([0]), ValueError, "cu_seqlens: .* does not start with 0"),
        (torch.tensor([[0, 2]]), TypeError, "cu_seqlens: expected a 1-D integer tensor"),
        (torch.tensor([0.0, 2.0]), TypeError, "cu_seqlens: dtype torch.float32"),
        (torch.tensor([False, True]), TypeError, "cu_seqlens: dtype torch.bool"),
        ([0, 2], TypeError, "cu_seqlens: expected a 1-D integer tensor"),
    ],
)
def test_actual_seq_lengths_refusals(value, error, message):
    with pytest.raises(error, match=message):
        actual_seq_lengths(value)


def test_memo_converts_each_tensor_once():
    memo = SeqLengthsMemo()
    cu_seqlens = _cu(3, 3, 5)
    for _ in range(10):
        assert memo.actual_seq_lengths(cu_seqlens) == (3, 3, 5)
    assert memo.conversions == 1 and len(memo) == 1
    same_values = _cu(3, 3, 5)
    assert memo.actual_seq_lengths(same_values) == (3, 3, 5)
    assert memo.conversions == 2


def test_memo_is_bounded_and_least_recently_used():
    memo = SeqLengthsMemo(capacity=2)
    a, b, c = _cu(1), _cu(2), _cu(3)
    memo.actual_seq_lengths(a)
    memo.actual_seq_lengths(b)
    memo.actual_seq_lengths(a)  # a is now the most recent
    memo.actual_seq_lengths(c)  # evicts b
    assert len(memo) == 2 and memo.conversions == 3
    memo.actual_seq_lengths(a)
    assert memo.conversions == 3
    assert memo.actual_seq_lengths(b) == (2,)
    assert memo.conversions == 4


def test_memo_does_not_confuse_a_tensor_that_reuses_an_id(monkeypatch):
    # Simulate id() reuse deterministically: every tensor gets the same id.
    monkeypatch.setattr(seqlens_module, "id", lambda obj: 42, raising=False)
    memo = SeqLengthsMemo()
    first, second = _cu(1, 2), _cu(7, 9)
    assert memo.actual_seq_lengths(first) == (1, 2)
    assert memo.actual_seq_lengths(second) == (7, 9)
    assert memo.conversions == 2


def test_memo_remember_needs_no_conversion_and_deepcopy_starts_empty():
    import copy

    memo = SeqLengthsMemo()
    cu_seqlens = _cu(4, 6)
    memo.remember(cu_seqlens, (4, 6))
    assert memo.actual_seq_lengths(cu_seqlens) == (4, 6)
    assert memo.conversions == 0
    clone = copy.deepcopy(memo)
    assert len(clone) == 0 and clone.capacity == memo.capacity


def test_memo_refuses_what_actual_seq_lengths_refuses():
    with pytest.raises(ValueError, match="cu_seqlens"):
        SeqLengthsMemo().actual_seq_lengths(torch.tensor([3, 5]))


# --------------------------------------------------------------------------------------------
# padding_to_packed
# --------------------------------------------------------------------------------------------

PADDED_BATCHES = {
    "right": [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]],
    "left": [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]],
    "mixed": [[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 1, 0]],
    "all_pad_row": [[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0]],
}


@pytest.mark.parametrize("name", list(PADDED_BATCHES))
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_padding_to_packed_round_trip(name, dtype):
    keep = torch.tensor(PADDED_BATCHES[name]).bool()
    batch = padding_to_packed(keep.to(dtype))
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(1))
    packed = batch.pack(x)
    assert torch.equal(packed, x[keep])  # real tokens, row after row, in order
    assert torch.equal(batch.unpack(packed), x * keep.unsqueeze(-1))


@pytest.mark.parametrize("name", list(PADDED_BATCHES))
def test_padding_to_packed_boundaries(name):
    keep = torch.tensor(PADDED_BATCHES[name]).bool()
    batch = padding_to_packed(keep)
    row_lengths = keep.sum(1).tolist()
    ends = torch.tensor(row_lengths).cumsum(0).tolist()
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, *ends]
    real_ends = tuple(e for n, e in zip(row_lengths, ends) if n)  # all-padding rows: no segment
    assert batch.lengths == SeqLengths(real_ends, real_ends)
    assert batch.max_seqlen == max(row_lengths)
    assert (batch.batch_size, batch.seq_len) == (3, 5)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("right", True), ("left", False), ("mixed", False), ("all_pad_row", True)],
)
def test_is_right_padded(name, expected):
    assert is_right_padded(torch.tensor(PADDED_BATCHES[name])) is expected


def test_padding_to_packed_refuses_a_non_2d_mask():
    with pytest.raises(ValueError, match="keep_mask"):
        padding_to_packed(torch.ones(5, dtype=torch.bool))


def test_packed_batch_feeds_megatron_params_and_a_memo_without_syncs():
    batch = padding_to_packed(torch.tensor(PADDED_BATCHES["mixed"]))
    memo = SeqLengthsMemo()
    batch.remember_in(memo)
    params = batch.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q is batch.cu_seqlens
    desc = describe_mask(
        AttnMaskType.causal, None, seq_q=12, seq_kv=12, packed_seq_params=params, memo=memo
    )
    assert desc == Packed(batch.lengths, BottomRightCausalMask())
    assert memo.conversions == 0


def _bsnd_qkv(batch, seq, seed):
    return _qkv((batch, seq, HEADS, HEAD_DIM), (batch, seq, HEADS, HEAD_DIM), seed)


def _attend(q, k, v, desc, layout):
    return npu_fusion_attention(
        q, k, v, HEADS, layout, scale=SCALE, **desc.operator_args().as_kwargs()
    )[0]


@pytest.mark.parametrize("name", list(PADDED_BATCHES))
def test_packed_attention_equals_dense_padding_mask_on_real_tokens(name):
    keep = torch.tensor(PADDED_BATCHES[name]).bool()
    q, k, v = _bsnd_qkv(3, 5, seed=3)  # [B, S, N, D]
    dense = _attend(q, k, v, ExplicitMask(build_npu_attention_mask(keep)), "BSND")
    batch = padding_to_packed(keep)
    packed_desc = Packed(batch.lengths, BottomRightCausalMask())
    packed = _attend(batch.pack(q), batch.pack(k), batch.pack(v), packed_desc, "TND")  # [T, N, D]
    assert (dense[keep] - packed).abs().max().item() <= ATOL


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_right_padded_causal_batch_needs_no_padding_mask(seed):
    keep = _keep_masks("right", 4, 9, seed)
    assert is_right_padded(keep)
    q, k, v = _bsnd_qkv(4, 9, seed)
    causal_only = _attend(q, k, v, TopLeftCausalMask(), "BSND")
    padded = _attend(q, k, v, ExplicitMask(build_npu_attention_mask(keep)), "BSND")
    assert keep.any()
    assert (causal_only[keep] - padded[keep]).abs().max().item() <= ATOL


def test_left_padded_causal_batch_does_need_the_padding_mask():
    # The control for the claim above: with left padding, real tokens see padding keys.
    keep = torch.tensor(PADDED_BATCHES["left"]).bool()
    q, k, v = _bsnd_qkv(3, 5, seed=5)
    causal_only = _attend(q, k, v, TopLeftCausalMask(), "BSND")
    padded = _attend(q, k, v, ExplicitMask(build_npu_attention_mask(keep)), "BSND")
    assert (causal_only[keep] - padded[keep]).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------


def _warm_packed_args():
    """Describe a thd causal batch through a memo that has seen its cu_seqlens, return a thunk."""
    memo = SeqLengthsMemo()
    params = _thd(_cu(3, 5))
    memo.actual_seq_lengths(params.cu_seqlens_q)

    def build():
        desc = describe_mask(
            AttnMaskType.causal, None, seq_q=5, seq_kv=5, packed_seq_params=params, memo=memo
        )
        return desc.operator_args().as_kwargs()

    return build


@pytest.mark.parametrize(
    "make_step",
    [
        pytest.param(lambda: TopLeftCausalMask().operator_args, id="top-left"),
        pytest.param(lambda: BottomRightCausalMask().operator_args, id="bottom-right"),
        pytest.param(lambda: SlidingWindow(4, 0).operator_args, id="window"),
        pytest.param(_warm_packed_args, id="packed"),
    ],
)
def test_operator_args_allocate_nothing_once_warm(make_step):
    step = make_step()
    step()  # warm-up: builds the compressed mask if this process has none yet
    with track_allocations() as usage:
        for _ in range(3):
            step()
    assert usage.allocated_bytes == 0


def test_build_npu_attention_mask_peaks_at_its_output():
    batch, seq = 4, 4096
    keep = _keep_masks("right", batch, seq, seed=0)
    with track_allocations() as usage:
        mask = build_npu_attention_mask(keep)
    output_bytes = batch * seq * seq  # bool
    assert mask.numel() * mask.element_size() == output_bytes == 64 * MiB
    assert output_bytes <= usage.peak_bytes <= 1.01 * output_bytes


def test_verls_mask_peaks_above_twice_its_output():
    # The control for the test above: the tracker does see verl's B x S x S temporaries.
    batch, seq = 4, 512
    keep = _keep_masks("right", batch, seq, seed=0)
    with track_allocations() as usage:
        _verl_build_npu_attn_mask(keep)
    assert usage.peak_bytes > 2 * batch * seq * seq


def test_memo_converts_again_after_an_in_place_update():
    memo = SeqLengthsMemo()
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    assert memo.actual_seq_lengths(cu) == (4, 8)
    cu.copy_(torch.tensor([0, 2, 8], dtype=torch.int32))  # a static buffer refilled for a new step
    assert memo.actual_seq_lengths(cu) == (2, 8)
    assert memo.conversions == 2


def test_context_parallel_ends_convert_once_per_tensor_and_check_divisibility():
    memo = SeqLengthsMemo()
    cu = torch.tensor([0, 8, 12, 24], dtype=torch.int32)
    for _ in range(5):  # every layer of a step asks
        assert memo.context_parallel_ends(cu, 2) == (4, 6, 12)
    assert memo.conversions == 1
    told = SeqLengthsMemo()
    told.remember(cu, (8, 12, 24))  # the trainer knows the offsets on the host
    assert told.context_parallel_ends(cu, 2) == (4, 6, 12) and told.conversions == 0
    with pytest.raises(ValueError, match="packed sequence 1 has padded length 4.*fix"):
        memo.context_parallel_ends(cu, 4)
