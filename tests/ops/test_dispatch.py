"""fusion_attention: kernel choice, pass-through to torch_npu, and the reference's output.

torch_npu is a stand-in module put into sys.modules (we have no NPU): it records its calls.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mcore_npu.masks import compressed_causal_mask
from mcore_npu.ops import (
    fusion_attention,
    fusion_attention_grad,
    fusion_attention_with_stats,
    resolve_kernel,
)
from mcore_npu.ops.reference import npu_fusion_attention


def _qkv():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 4 * 8, generator=gen)  # SBH: S=6, B=2, 4 heads of 8
    kv = torch.randn(6, 2, 2 * 8, generator=gen)  # 2 kv heads (GQA)
    return q, kv, kv.clone()


def test_torch_npu_receives_exactly_the_arguments_given(fake_torch_npu):
    q, k, v = _qkv()
    mask = compressed_causal_mask()
    kwargs = dict(atten_mask=mask, scale=0.125, sparse_mode=2, keep_prob=1.0)
    out = fusion_attention(q, k, v, 4, "SBH", kernel="torch_npu", **kwargs)
    assert len(fake_torch_npu.calls) == 1
    args, got_kwargs = fake_torch_npu.calls[0]
    assert args[0] is q and args[1] is k and args[2] is v and args[3:] == (4, "SBH")
    assert got_kwargs.keys() == kwargs.keys()
    assert got_kwargs["atten_mask"] is mask
    assert all(got_kwargs[name] == kwargs[name] for name in ("scale", "sparse_mode", "keep_prob"))
    assert out.shape == q.shape


def test_auto_runs_the_reference_for_cpu_tensors(fake_torch_npu):
    q, k, v = _qkv()
    out = fusion_attention(q, k, v, 4, "SBH", kernel="auto", atten_mask=compressed_causal_mask(),
                           scale=0.125, sparse_mode=2)  # fmt: skip
    assert fake_torch_npu.calls == []
    kwargs = dict(atten_mask=compressed_causal_mask(), scale=0.125, sparse_mode=2)
    want = fusion_attention(q, k, v, 4, "SBH", kernel="reference", **kwargs)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # the 7-tuple (statistics) path computes the output in its own blocked pass: equal up to
    # float32 rounding, not bit for bit
    torch.testing.assert_close(npu_fusion_attention(q, k, v, 4, "SBH", **kwargs)[0], want)


def test_auto_picks_torch_npu_for_npu_devices(fake_torch_npu):
    # torch.device("npu") exists only once torch_npu registers it; a stand-in device object here
    assert resolve_kernel("auto", types.SimpleNamespace(type="npu", index=0)) == "torch_npu"
    assert resolve_kernel("auto", torch.device("cpu")) == "reference"
    assert resolve_kernel("auto", torch.device("meta")) == "reference"


def test_auto_on_an_npu_without_torch_npu_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # the import fails
    npu = types.SimpleNamespace(type="npu", index=0)
    with pytest.warns(UserWarning, match="fusion_attention: using the PyTorch reference on the "
                      "NPU \\(torch_npu: failed to import"):  # fmt: skip
        assert resolve_kernel("auto", npu) == "reference"


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel: unknown kernel 'npu'"):
        resolve_kernel("npu", torch.device("cpu"))


def test_misspelt_operator_keyword_gets_a_suggestion():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="did you mean 'pre_tockens'"):
        fusion_attention(q, k, v, 4, "SBH", pre_tokens=3)


def test_missing_torch_npu_says_why_and_how_to_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes the import raise ImportError
    q, k, v = _qkv()
    with pytest.raises(ImportError, match="failed to import.*\n.*set_env.sh"):
        fusion_attention(q, k, v, 4, "SBH", kernel="torch_npu", scale=0.1)


def test_reference_returns_the_operator_seven_tuple():
    q, k, v = _qkv()
    out, smax, ssum, reserved, seed, offset, numels = npu_fusion_attention(
        q, k, v, 4, "SBH", scale=0.125, atten_mask=compressed_causal_mask(), sparse_mode=3
    )
    assert out.shape == (6, 2, 32)
    assert smax.shape == ssum.shape == (2, 4, 6, 8) and smax.dtype == torch.float32
    assert reserved.numel() == 0 and (seed, offset) == (0, 0) and numels == 2 * 4 * 6 * 6
    # log-sum-exp from the statistics equals the one computed directly
    qh = q.view(6, 2, 4, 8).permute(1, 2, 0, 3)
    kh = k.view(6, 2, 2, 8).permute(1, 2, 0, 3).repeat_interleave(2, 1)
    scores = (qh @ kh.transpose(-1, -2)) * 0.125
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    lse = smax[..., 0] + ssum[..., 0].log()
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


def test_invalid_rows_get_sentinel_statistics():
    q = torch.randn(1, 5, 1, 4)
    k = torch.randn(1, 3, 1, 4)
    _, smax, ssum, *_ = npu_fusion_attention(q, k, k, 1, "BSND", atten_mask=compressed_causal_mask(),
                                             sparse_mode=3)  # fmt: skip
    finfo = torch.finfo(torch.float32)
    assert torch.all(smax[0, 0, :2] == finfo.min) and torch.all(ssum[0, 0, :2] == finfo.max)
    assert torch.all(torch.isfinite(smax)) and torch.all(smax[0, 0, 2:] > finfo.min)


def test_tnd_statistics_are_filled_per_segment_n_major():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 2, 4, generator=gen)
    lens = dict(actual_seq_qlen=[2, 5], actual_seq_kvlen=[2, 5])
    _, smax, *_ = npu_fusion_attention(q, q, q, 2, "TND", scale=0.5, **lens)
    # segment 2 alone, in BNSD, gives its [1, N, 3, 8] block; TND stores it flattened after
    # segment 1's [1, N, 2, 8] block
    seg2 = npu_fusion_attention(q[2:].transpose(0, 1)[None], q[2:].transpose(0, 1)[None],
                                q[2:].transpose(0, 1)[None], 2, "BNSD", scale=0.5)[1]  # fmt: skip
    torch.testing.assert_close(smax.reshape(-1)[2 * 2 * 8 :], seg2.reshape(-1))


def test_grad_operator_reaches_torch_npu_with_its_own_spelling(fake_torch_npu):
    q, k, v = _qkv()
    dy = torch.randn(q.shape)
    stats = torch.zeros(2, 4, 6, 8)
    kwargs = dict(atten_mask=compressed_causal_mask(), scale_value=0.125, sparse_mode=2,
                  softmax_max=stats, softmax_sum=stats, attention_in=dy)  # fmt: skip
    dq, dk, dv, dpse = fusion_attention_grad(q, k, v, dy, 4, "SBH", kernel="torch_npu", **kwargs)
    ((args, got),) = fake_torch_npu.grad_calls
    assert args[0] is q and args[3] is dy and args[4:] == (4, "SBH")
    assert got.keys() == kwargs.keys() and got["softmax_max"] is stats
    assert dq.shape == q.shape and dk.shape == k.shape and dpse is None
    with pytest.raises(TypeError, match="did you mean 'scale_value'"):
        fusion_attention_grad(q, k, v, dy, 4, "SBH", kernel="torch_npu", scale=0.1)


def test_grad_operator_reference_matches_autograd_and_stats_forward_matches():
    q, k, v = (t.double().requires_grad_() for t in _qkv())
    kwargs = dict(atten_mask=compressed_causal_mask(), sparse_mode=2)
    out, smax, ssum = fusion_attention_with_stats(q, k, v, 4, "SBH", scale=0.125, **kwargs)
    assert smax.shape == ssum.shape == (2, 4, 6, 8) and smax.dtype == torch.float32
    dy = torch.randn(out.shape, dtype=torch.float64)
    out.backward(dy)
    grads = fusion_attention_grad(q.detach(), k.detach(), v.detach(), dy, 4, "SBH",
                                  kernel="reference", scale_value=0.125, softmax_max=smax,
                                  softmax_sum=ssum, attention_in=out.detach(), **kwargs)  # fmt: skip
    assert grads[3] is None
    for got, leaf in zip(grads[:3], (q, k, v)):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-6)
