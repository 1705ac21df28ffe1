"""Property test: random shapes, modes, windows, GQA ratios and TND segmentations vs the oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mcore_npu.masks import compressed_causal_mask
from mcore_npu.ops.reference import npu_fusion_attention
from tests.ops.oracle import oracle

INT32_MAX = 2147483647


@st.composite
def problems(draw):
    layout = draw(st.sampled_from(["BSH", "SBH", "BSND", "BNSD", "TND"]))
    heads_kv = draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 6))
    modes = [0, 1, 2, 3, 4, 7, 8] if layout == "TND" else [0, 1, 2, 3, 4]
    mode = draw(st.sampled_from(modes))
    if layout == "TND":
        n = draw(st.integers(1, 4))
        q_lens = draw(st.lists(st.integers(0, 7), min_size=n, max_size=n))
        kv_lens = [draw(st.integers(1 if q else 0, 7)) for q in q_lens]
        assume(q_lens[0] > 0)  # a leading 0 in actual_seq_qlen is refused (unsliced cu_seqlens)
        pairs, batch = list(zip(q_lens, kv_lens)), 1
    else:
        pairs = [(draw(st.integers(1, 9)), draw(st.integers(1, 9)))]
        batch = draw(st.integers(1, 2))
    pre = draw(st.one_of(st.just(INT32_MAX), st.integers(0, 10)))
    nxt = draw(st.one_of(st.just(INT32_MAX), st.integers(0, 10)))
    if mode in (7, 8):
        band = [s for s, (q, kv) in enumerate(pairs) if (q if mode == 7 else kv) > 0]
        assume(band)
        sq, skv = pairs[band[-1] if mode == 7 else band[0]]
        pre = skv + draw(st.integers(0, 3))
        low, high = sq - skv, (0 if mode == 7 else sq - skv + 5)
        assume(low <= high)
        nxt = draw(st.integers(low, high))
    return (
        layout,
        batch,
        heads_q,
        heads_kv,
        head_dim,
        pairs,
        mode,
        pre,
        nxt,
        draw(st.integers(0, 2**31)),
    )


def _tensors(layout, batch, hq, hkv, d, pairs, gen):
    if layout == "TND":
        tq, tkv = sum(q for q, _ in pairs), sum(kv for _, kv in pairs)
        shapes = (tq, hq, d), (tkv, hkv, d)
    else:
        sq, skv = pairs[0]
        shapes = {
            "BSH": ((batch, sq, hq * d), (batch, skv, hkv * d)),
            "SBH": ((sq, batch, hq * d), (skv, batch, hkv * d)),
            "BSND": ((batch, sq, hq, d), (batch, skv, hkv, d)),
            "BNSD": ((batch, hq, sq, d), (batch, hkv, skv, d)),
        }[layout]
    q = torch.randn(shapes[0], generator=gen, dtype=torch.float64)
    k, v = (torch.randn(shapes[1], generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


@pytest.mark.filterwarnings("ignore:npu_fusion_attention. pre_tockens")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(problems())
def test_reference_matches_oracle_on_random_problems(problem):
    layout, batch, hq, hkv, d, pairs, mode, pre, nxt, seed = problem
    gen = torch.Generator().manual_seed(seed)
    q, k, v = _tensors(layout, batch, hq, hkv, d, pairs, gen)
    kwargs = {"scale": 0.7, "sparse_mode": mode}
    if (pre, nxt) != (INT32_MAX, INT32_MAX) and mode in (0, 4, 7, 8):
        kwargs.update(pre_tockens=pre, next_tockens=nxt)
    if mode in (2, 3, 4, 7, 8):
        kwargs["atten_mask"] = compressed_causal_mask()
    elif mode == 1 or (mode == 0 and pre != INT32_MAX):
        sq, skv = max(p[0] for p in pairs), max(p[1] for p in pairs)
        masked = torch.rand(sq, skv, generator=gen) < 0.5
        masked[:, 0] = False  # TND masks must leave no row empty
        if mode == 0:
            i, j = torch.arange(sq)[:, None], torch.arange(skv)
            masked |= ~((j - i >= -pre) & (j - i <= nxt))
            crops = [(~masked[:q, :kv]).any(1).all() for q, kv in pairs if kv > 0]
            assume(layout != "TND" or all(bool(c) for c in crops))
        kwargs["atten_mask"] = masked
    if layout == "TND":
        kwargs["actual_seq_qlen"] = list(_ends(q for q, _ in pairs))
        kwargs["actual_seq_kvlen"] = list(_ends(kv for _, kv in pairs))
    got = npu_fusion_attention(q, k, v, hq, layout, **kwargs)[0]
    want, valid = oracle(q, k, v, hq, layout, **kwargs)
    assert got.shape == want.shape
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-10, atol=1e-10)
    assert torch.all(got[~valid] == 0)


def _ends(lengths):
    total = 0
    for n in lengths:
        total += n
        yield total
