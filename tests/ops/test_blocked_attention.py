"""The statistics path's blocked kernel (mcore_npu.ops.blocked_attention) against the contract.

Blocks are made tiny (a few rows, KV heads grouped in twos) so that every boundary is crossed:
row blocks, the causal diagonal square, head groups, GQA groups, batches, TND segments. The
expected values are computed here in float64 from the definition: ``softmax_max`` = row max of
the scaled, masked scores, ``softmax_sum`` = sum exp(score - max).
"""

from __future__ import annotations

import pytest
import torch

from mcore_npu.masks import compressed_causal_mask
from mcore_npu.ops import attention_reference as ref
from mcore_npu.ops import blocked_attention, fusion_attention_with_stats
from mcore_npu.tools.bench.memory import track_allocations


@pytest.fixture(params=[1, 3], ids=["inline", "3-workers"])
def tiny_blocks(monkeypatch, request):
    """Blocks of 4 rows and two KV heads per worker, run inline or shared by 3 worker threads."""
    monkeypatch.setattr(blocked_attention, "BLOCK_ROWS", 4)
    monkeypatch.setattr(blocked_attention, "MIN_BLOCK_BYTES", 0)
    monkeypatch.setattr(blocked_attention, "_workers", lambda q, scores: request.param)
    calls = []
    kernel = blocked_attention.attention_with_statistics

    def counted(q, k, v, *args):
        calls.append(q.shape)
        scores = request.param * 2 * (q.shape[1] // k.shape[1]) * 4 * k.shape[2] * 4
        monkeypatch.setattr(blocked_attention, "BLOCK_BYTES", scores)
        return kernel(q, k, v, *args)

    monkeypatch.setattr(ref, "attention_with_statistics", counted)
    return calls


def _dense(q, k, v, causal, scale, offset=0):
    """float64 ``(out, max, sum)`` of BNSD q/k/v; causal keeps key j <= i + offset."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q.double() @ k.mT * scale
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(offset)
        scores = scores.masked_fill(~keep, float("-inf"))
    row_max = scores.amax(-1)
    row_sum = (scores - row_max[..., None]).exp().sum(-1)
    return torch.softmax(scores, -1) @ v, row_max, row_sum


def _layout(t, layout):
    """BNSD ``[B, N, S, D]`` -> the layout (a fresh contiguous tensor)."""
    if layout == "BSND":
        return t.transpose(1, 2).contiguous()
    if layout == "BSH":
        return t.transpose(1, 2).flatten(2).contiguous()
    if layout == "SBH":
        return t.permute(2, 0, 1, 3).flatten(2).contiguous()
    return t.contiguous()


def _check(got, want_out, want_max, want_sum, layout):
    out, smax, ssum = got
    torch.testing.assert_close(out.double(), _layout(want_out, layout), rtol=1e-5, atol=1e-5)
    assert smax.dtype == ssum.dtype == torch.float32 and smax.shape[-1] == 8
    assert torch.equal(smax, smax[..., :1].expand_as(smax))
    torch.testing.assert_close(smax[..., 0].double(), want_max, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ssum[..., 0].double(), want_sum, rtol=1e-5, atol=0)


CASES = [  # layout, (Sq, Skv), (Nq, Nkv), D, Dv, sparse mode (None: no mask, full)
    ("SBH", (11, 11), (4, 2), 8, 8, 2),
    ("BSH", (11, 11), (6, 6), 8, 8, None),
    ("BSND", (9, 13), (4, 1), 8, 6, 2),
    ("BNSD", (13, 9), (6, 3), 8, 8, 2),
    ("BNSD", (10, 10), (2, 2), 8, 5, 3),
    ("BSND", (7, 12), (4, 2), 8, 8, None),
    ("BNSD", (0, 5), (2, 2), 8, 8, None),  # no query rows: empty results of the right shape
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}-mode{c[5]}" for c in CASES])
def test_blocked_statistics_match_the_definition(tiny_blocks, case):
    layout, (seq_q, seq_kv), (heads_q, heads_kv), dim, dim_v, mode = case
    gen = torch.Generator().manual_seed(seq_q * 100 + seq_kv)
    q = torch.randn(2, heads_q, seq_q, dim, generator=gen)
    k = torch.randn(2, heads_kv, seq_kv, dim, generator=gen)
    v = torch.randn(2, heads_kv, seq_kv, dim_v, generator=gen)
    kwargs = {} if mode is None else dict(atten_mask=compressed_causal_mask(), sparse_mode=mode)
    got = fusion_attention_with_stats(*(_layout(t, layout) for t in (q, k, v)), heads_q, layout,
                                      kernel="reference", scale=0.3, **kwargs)  # fmt: skip
    assert len(tiny_blocks) == 1  # the blocked kernel ran
    _check(got, *_dense(q, k, v, mode is not None, 0.3), layout)


def test_blocked_statistics_of_packed_segments(tiny_blocks):
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(15, 4, 8, generator=gen) for _ in range(3))  # TND, 2 segments
    lens = dict(actual_seq_qlen=[6, 15], actual_seq_kvlen=[6, 15])
    out, smax, ssum = fusion_attention_with_stats(
        q, k, v, 4, "TND", kernel="reference", scale=0.5, atten_mask=compressed_causal_mask(),
        sparse_mode=3, **lens,
    )  # fmt: skip
    assert len(tiny_blocks) == 2
    for a, b in ((0, 6), (6, 15)):
        seg = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]  # [1, N, S_s, D]
        want_out, want_max, want_sum = _dense(*seg, True, 0.5)
        torch.testing.assert_close(
            out[a:b].double(), want_out[0].transpose(0, 1), rtol=1e-5, atol=1e-5
        )
        # TND statistics: segment by segment, N-major ([N, S_s, 8] flattened)
        flat = smax.reshape(-1)[a * 4 * 8 : b * 4 * 8].view(4, b - a, 8)
        torch.testing.assert_close(flat[..., 0].double(), want_max[0], rtol=1e-6, atol=1e-6)
        flat = ssum.reshape(-1)[a * 4 * 8 : b * 4 * 8].view(4, b - a, 8)
        torch.testing.assert_close(flat[..., 0].double(), want_sum[0], rtol=1e-5, atol=0)


def test_recording_autograd_takes_the_differentiable_path(tiny_blocks):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(9, 1, 2 * 8, generator=gen, requires_grad=True) for _ in range(3))
    kwargs = dict(kernel="reference", scale=0.25, atten_mask=compressed_causal_mask(),
                  sparse_mode=2)  # fmt: skip
    out, smax, ssum = fusion_attention_with_stats(q, k, v, 2, "SBH", **kwargs)
    assert tiny_blocks == [] and out.requires_grad
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    threads = torch.get_num_threads()
    with torch.no_grad():  # grad mode is thread-local: the workers must disable it themselves
        blocked = fusion_attention_with_stats(q, k, v, 2, "SBH", **kwargs)
    assert len(tiny_blocks) == 1 and torch.get_num_threads() == threads
    torch.testing.assert_close(blocked[0], out)
    torch.testing.assert_close(blocked[1], smax)
    torch.testing.assert_close(blocked[2], ssum)


def test_reduced_precision_keeps_its_dtype_and_float32_statistics(tiny_blocks):
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=gen) for _ in range(3))
    out, smax, _ = fusion_attention_with_stats(*(t.bfloat16() for t in (q, k, v)), 2, "BNSD",
                                               kernel="reference", scale=0.3)  # fmt: skip
    assert out.dtype == torch.bfloat16 and smax.dtype == torch.float32
    want_out, want_max, _ = _dense(*(t.bfloat16() for t in (q, k, v)), False, 0.3)
    torch.testing.assert_close(out.double(), want_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(smax[..., 0].double(), want_max, rtol=1e-6, atol=1e-6)


def test_peak_is_output_statistics_and_one_score_block(monkeypatch):
    """S = 512, 4 heads: no [N, S, S] score tensor (4 MiB); at most one 256 KiB block."""
    monkeypatch.setattr(blocked_attention, "BLOCK_BYTES", 256 * 2**10)
    gen = torch.Generator().manual_seed(0)
    seq, heads, dim = 512, 4, 32
    q, k, v = (torch.randn(seq, 1, heads * dim, generator=gen) for _ in range(3))
    kwargs = dict(kernel="reference", scale=dim**-0.5, atten_mask=compressed_causal_mask(),
                  sparse_mode=2)  # fmt: skip
    with track_allocations() as usage:
        out, smax, ssum = fusion_attention_with_stats(q, k, v, heads, "SBH", **kwargs)
    results = sum(t.numel() * t.element_size() for t in (out, smax, ssum))
    small = 2 * heads * seq * 4 + 64 * 2**10  # [B, N, S] max/sum buffers, per-block outputs
    assert usage.peak_bytes <= results + 256 * 2**10 + small
