"""``batch_invariant_attention``: the reference gives a sequence the same bits alone, packed
among others or right-padded; SDPA, the path the mode replaces, does not (the control); the
Ascend kernel gets MindSpeed's arguments (a stand-in ``flash_attn_npu``, no NPU here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_npu.ops import batch_invariant_attention, registry
from mcore_npu.ops.batch_invariant import check_limits
from tests.flash_attn_npu_standin import install

HEADS, GROUPS, DIM, SCALE = 4, 2, 16, 0.25
LENGTHS = (70, 5, 130)  # across block edges (BLOCK = 64), one shorter than a block


def _sequences(lengths, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda n, h: torch.randn(n, h, DIM, generator=gen).to(dtype)  # noqa: E731
    return [(make(n, HEADS), make(n, GROUPS), make(n, GROUPS)) for n in lengths]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _alone(seq, causal=True, kernel="auto"):
    q, k, v = seq
    return batch_invariant_attention(q, k, v, layout="TND", causal=causal, scale=SCALE,
                                     cu_seqlens=_cu([len(q)]), max_seqlen=len(q), kernel=kernel)  # fmt: skip


def _packed(seqs, causal=True, kernel="auto"):
    q, k, v = (torch.cat(parts) for parts in zip(*seqs, strict=True))
    lengths = [len(s[0]) for s in seqs]
    out = batch_invariant_attention(q, k, v, layout="TND", causal=causal, scale=SCALE,
                                    cu_seqlens=_cu(lengths), max_seqlen=max(lengths), kernel=kernel)  # fmt: skip
    return out.split(lengths)


def _right_padded(seqs, filler=3.0):
    """``[B, S, H, D]`` each, padded with ``filler`` (not zeros: padding must not matter)."""
    size = max(len(s[0]) for s in seqs)
    pad = lambda t: F.pad(t, (0, 0, 0, 0, 0, size - len(t)), value=filler)  # noqa: E731
    return [torch.stack([pad(s[i]) for s in seqs]) for i in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_a_sequence_has_the_same_bits_alone_first_last_packed_and_right_padded(dtype, causal):
    seqs = _sequences(LENGTHS, dtype)
    alone = [_alone(s, causal) for s in seqs]
    for order in (seqs, seqs[::-1]):  # each sequence first and last
        got = _packed(order, causal)
        want = alone if order is seqs else alone[::-1]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    if causal:  # right padding is causal attention's (no-mask rows would see the padding)
        q, k, v = _right_padded(seqs)
        out = batch_invariant_attention(q, k, v, layout="BSND", causal=True, scale=SCALE)
        for row, want in enumerate(alone):
            assert torch.equal(out[row, : len(want)], want)


@pytest.mark.parametrize("causal", [True, False])
def test_the_reference_is_attention(causal):
    for q, k, v in _sequences(LENGTHS):
        want = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal,
            scale=SCALE, enable_gqa=True,
        ).transpose(0, 1)  # fmt: skip
        torch.testing.assert_close(_alone((q, k, v), causal), want, atol=2e-6, rtol=1e-5)


def test_control_sdpa_over_a_right_padded_batch_is_not_batch_invariant():
    """What the guarantee is for: the fused CPU kernel splits keys by the padded length, so the
    short row's bits change with its neighbour (600 keys: blocks of 512 + 88, against one of 37)."""
    seqs = _sequences((600, 37))
    q, k, v = (t.transpose(1, 2) for t in _right_padded(seqs))
    padded = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
    short_q, short_k, short_v = (t.transpose(0, 1)[None] for t in seqs[1])
    alone = F.scaled_dot_product_attention(
        short_q, short_k, short_v, is_causal=True, scale=SCALE, enable_gqa=True
    )
    assert not torch.equal(padded[1:, :, :37], alone)
    ours = _right_padded(seqs)
    out = batch_invariant_attention(*ours, layout="BSND", causal=True, scale=SCALE)
    assert torch.equal(out[1, :37], _alone(seqs[1]))


def test_the_reference_is_differentiable_and_its_gradient_is_batch_invariant():
    seqs = [tuple(t.requires_grad_() for t in s) for s in _sequences((70, 5))]
    alone = _alone(seqs[1])
    (grad_alone,) = torch.autograd.grad(alone.square().sum(), seqs[1][0])
    packed = _packed(seqs)[1]
    (grad_packed,) = torch.autograd.grad(packed.square().sum(), seqs[1][0])
    assert torch.equal(grad_alone, grad_packed)


def test_on_the_npu_kernel_the_calls_are_flash_attn_npus_with_mindspeeds_arguments(monkeypatch):
    standin = install(monkeypatch)
    seqs = _sequences(LENGTHS)
    packed = _packed(seqs, kernel="flash_attn_npu")
    q, k, v = _right_padded(seqs)
    batch_invariant_attention(q, k, v, layout="BSND", causal=True, scale=SCALE,
                              kernel="flash_attn_npu")  # fmt: skip
    (varlen, args, kwargs), (dense, dense_args, dense_kwargs) = standin.calls
    assert varlen == "flash_attn_varlen_func" and dense == "flash_attn_func"
    common = dict(dropout_p=0.0, softmax_scale=SCALE, causal=True, window_size=(-1, -1),
                  alibi_slopes=None, deterministic=False, return_attn_probs=False)  # fmt: skip
    assert kwargs == {**common, "block_table": None} and dense_kwargs == common
    cu_q, cu_k, max_q, max_k = args[3:]
    assert cu_q.dtype == torch.int32 and cu_q.tolist() == [0, 70, 75, 205]
    assert cu_k.tolist() == cu_q.tolist() and max_q == max_k == 130
    assert [t.shape for t in args[:3]] == [(205, HEADS, DIM)] + [(205, GROUPS, DIM)] * 2
    assert [t.shape for t in dense_args] == [(3, 130, HEADS, DIM)] + [(3, 130, GROUPS, DIM)] * 2
    assert all(torch.equal(p, a) for p, a in zip(packed, [_alone(s) for s in seqs], strict=True))


def test_auto_takes_flash_attn_npu_on_an_npu_and_names_it_in_the_registry(monkeypatch):
    install(monkeypatch)
    assert registry.resolve("batch_invariant_attention", "auto", "npu").kernel == "flash_attn_npu"
    assert registry.resolve("batch_invariant_attention", "auto", "cpu").kernel == "reference"


@pytest.mark.parametrize(
    ("facts", "fragment"),
    [
        (dict(context_parallel_size=2), "context_parallel_size=2: use 1"),
        (dict(dropout=0.1), "attention_dropout=0.1: use 0.0"),
        (dict(head_dim=320), "head dim 320 > 256"),
        (dict(mask_kind="arbitrary"), "attn_mask_type=arbitrary: use causal or no_mask"),
        (dict(window=(128, 0)), "window_size=(128, 0) (sliding window)"),
    ],
)
def test_each_limit_of_the_mode_is_refused_in_one_line(facts, fragment):
    with pytest.raises(ValueError, match="^batch-invariant mode does not support ") as error:
        check_limits(**facts)
    assert fragment in str(error.value) and "\n" not in str(error.value)
    check_limits(head_dim=256, mask_kind="no_mask")  # the edges pass
