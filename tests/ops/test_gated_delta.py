"""The chunked gated delta rule (and its companions) against a float64 token-by-token oracle.

Every quantity is compared as ``max|got - want| <= TOL * max(1, max|want|)`` with TOL = 2e-5 in
fp32: the output, the final state and the gradients of q, k, v, g, beta and the initial state.
The oracle (``mcore_npu.tools.gdn_cases.recurrent_rule``) runs the recurrence token by token in
float64 and shares no code with ``mcore_npu.ops``.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mcore_npu.ops.gated_delta import causal_conv1d, chunk_gated_delta_rule, gated_rms_norm, l2norm
from mcore_npu.ops.gated_delta.chunked import chunked_gated_delta_rule
from mcore_npu.tools.gdn_cases import conv_oracle, recurrent_rule

TOL = 2e-5
NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _inputs(t, *, b=1, h=2, hv=4, dk=16, dv=8, decay=-1.0, strong=False, unit=True, seed=0):
    """float64 inputs: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta, h0."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, h, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    if unit:
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(b, t, hv, dv, generator=gen, dtype=torch.float64)
    g = torch.full((b, t, hv), decay, dtype=torch.float64) if strong else (
        decay * torch.rand(b, t, hv, generator=gen, dtype=torch.float64))  # fmt: skip
    beta = torch.rand(b, t, hv, generator=gen, dtype=torch.float64)
    h0 = 0.5 * torch.randn(b, hv, dk, dv, generator=gen, dtype=torch.float64)
    return [q, k, v, g, beta, h0]


def _upstream(o_shape, f_shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*o_shape, generator=gen, dtype=torch.float64),
            torch.randn(*f_shape, generator=gen, dtype=torch.float64))  # fmt: skip


def _run(fn, leaves, ups):
    """``fn(*leaves) -> (o, final)``; returns o, final and the six gradients (float64)."""
    leaves = [x.detach().requires_grad_() for x in leaves]
    o, final = fn(*leaves)
    loss = (o * ups[0].to(o)).sum() + (final * ups[1].to(final)).sum()
    grads = torch.autograd.grad(loss, leaves)
    return [x.detach().double() for x in (o, final, *grads)]


def _oracle(leaves, l2norm_in_kernel=False, bounds=None):
    def fn(q, k, v, g, beta, h0):
        return recurrent_rule(q, k, v, g, beta, initial_state=h0, bounds=bounds,
                              l2norm=l2norm_in_kernel)  # fmt: skip

    o_shape = leaves[2].shape
    f_shape = leaves[5].shape
    return _run(fn, leaves, _upstream(o_shape, f_shape))


def _assert_close(got, want, tol=TOL):
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert torch.isfinite(a).all(), name
        err, size = (a - b).abs().max().item(), max(1.0, b.abs().max().item())
        assert err <= tol * size, f"{name}: max error {err:.2e} > {tol * size:.2e}"


@functools.cache
def _oracle_for_length(t: int):
    leaves = _inputs(t, seed=t)
    return leaves, _oracle(leaves)


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
def test_matches_the_float64_oracle_in_fp32(t, chunk):
    """GVA (H 2, HV 4) and K 16 != V 8 in every case, with an initial state."""
    leaves, want = _oracle_for_length(t)

    def fn(q, k, v, g, beta, h0):
        return chunked_gated_delta_rule(q, k, v, g, beta, scale=16**-0.5, initial_state=h0,
                                        output_final_state=True, chunk_size=chunk)  # fmt: skip

    got = _run(fn, [x.float() for x in leaves], _upstream(want[0].shape, want[1].shape))
    _assert_close(got, want)


def test_chunk_size_changes_round_off_only():
    leaves = [x.float() for x in _inputs(150, seed=3)]
    outs = [chunked_gated_delta_rule(*leaves[:5], scale=0.25, initial_state=leaves[5],
                                     output_final_state=True, chunk_size=c) for c in (16, 64)]  # fmt: skip
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=3e-6)


def test_in_kernel_l2norm_matches_the_oracle():
    leaves = _inputs(70, unit=False, seed=5)
    want = _oracle(leaves, l2norm_in_kernel=True)

    def fn(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)  # fmt: skip

    _assert_close(_run(fn, [x.float() for x in leaves], _upstream(want[0].shape, want[1].shape)),
                  want)  # fmt: skip


def test_strong_decay_stays_exact_and_finite():
    """g = -40 per token: the cumulative decay reaches -2560 inside a 64-token chunk."""
    leaves = _inputs(130, strong=True, decay=-40.0, seed=7)
    want = _oracle(leaves)

    def fn(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    got = _run(fn, [x.float() for x in leaves], _upstream(want[0].shape, want[1].shape))
    assert leaves[3][0, :64, 0].sum() < -1000
    _assert_close(got, want)


def test_packed_segments_equal_each_segment_alone():
    lengths = [5, 70, 0, 1, 33]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    q, k, v, g, beta, _ = (x.float() for x in _inputs(bounds[-1], seed=11))
    h0 = 0.5 * torch.randn(len(lengths), 4, 16, 8, generator=torch.Generator().manual_seed(1))
    cu = torch.tensor(bounds, dtype=torch.int32)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], cu_seqlens=cu,
                                      output_final_state=True)  # fmt: skip
    ups = _upstream(o.shape, final.shape)
    grads = torch.autograd.grad((o * ups[0].float()).sum() + (final * ups[1].float()).sum(), leaves)
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        alone = [x.detach()[:, s:e].requires_grad_() for x in (q, k, v, g, beta)]
        init = h0.detach()[n : n + 1].requires_grad_()
        o1, f1 = chunk_gated_delta_rule(*alone, initial_state=init, output_final_state=True)
        loss = (o1 * ups[0][:, s:e].float()).sum() + (f1 * ups[1][n : n + 1].float()).sum()
        g1 = torch.autograd.grad(loss, [*alone, init], allow_unused=True)
        torch.testing.assert_close(o1, o[:, s:e], rtol=0, atol=1e-6)
        torch.testing.assert_close(f1, final[n : n + 1], rtol=0, atol=1e-6)
        for got, whole in zip(g1[:5], grads[:5]):
            if e > s:
                torch.testing.assert_close(got, whole[:, s:e], rtol=0, atol=1e-6)
        torch.testing.assert_close(g1[5], grads[5][n : n + 1], rtol=0, atol=1e-6)
    _assert_close(
        [x.detach().double() for x in (o, final, *grads)],
        _oracle([q, k, v, g, beta, h0], bounds=bounds),
    )  # fmt: skip


def test_bf16_stays_within_bf16_round_off():
    """bf16 inputs: the error to the float64 answer on the same rounded inputs is a few bf16
    ulps of the result (8e-3 of its size; one rounding is 3.9e-3), far below what fp32
    accumulation errors in bf16 would give."""
    leaves = [x.bfloat16() for x in _inputs(100, seed=13)]
    want = _oracle([x.double() for x in leaves])

    def fn(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    got = _run(fn, leaves, _upstream(want[0].shape, want[1].shape))
    for name, a, b in zip(NAMES, got, want):
        err, size = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= 8e-3 * size, f"{name}: {err:.2e} > 8e-3 * {size:.2e}"


def test_output_dtype_and_state_dtype():
    q, k, v, g, beta, _ = (x.bfloat16() for x in _inputs(9, seed=17))
    o, final = chunk_gated_delta_rule(q, k, v, g.float(), beta, output_final_state=True)
    assert o.dtype == torch.bfloat16 and o.shape == v.shape
    assert final.dtype == torch.float32 and final.shape == (1, 4, 16, 8)
    assert chunk_gated_delta_rule(q, k, v, g, beta)[1] is None


def test_causal_conv1d_matches_the_oracle_and_packed_equals_each_segment():
    gen = torch.Generator().manual_seed(19)
    bounds = [0, 3, 4, 12, 14]
    x = torch.randn(1, 14, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor(bounds)
    y = causal_conv1d(x.float(), w.float(), cu_seqlens=cu)
    torch.testing.assert_close(y.double(), conv_oracle(x, w, bounds), rtol=0, atol=1e-6)
    for s, e in zip(bounds[:-1], bounds[1:]):
        alone = causal_conv1d(x[:, s:e].float(), w.float())
        torch.testing.assert_close(alone, y[:, s:e], rtol=0, atol=0)
    full = causal_conv1d(x, w)
    assert not torch.allclose(full[:, 3:], conv_oracle(x, w, bounds)[:, 3:])  # boundaries matter
    torch.testing.assert_close(full, conv_oracle(x, w), rtol=0, atol=1e-12)


def test_l2norm_is_the_naive_formula_in_the_input_dtype():
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(l2norm(x), x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
    tiny = torch.full((2, 4), 1e-4)
    assert l2norm(tiny).dtype == torch.float32
    torch.testing.assert_close(l2norm(tiny), tiny / (4e-8 + 1e-6) ** 0.5)  # eps counts
    assert l2norm(x.bfloat16()).dtype == torch.bfloat16


def test_gated_rms_norm_is_weight_times_norm_times_silu_gate():
    gen = torch.Generator().manual_seed(23)
    x, z = (torch.randn(4, 3, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    w = torch.rand(8, generator=gen, dtype=torch.float64) + 0.5
    want = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * z * torch.sigmoid(z)
    torch.testing.assert_close(gated_rms_norm(x, z, w, 1e-6), want)
    got = gated_rms_norm(x.bfloat16(), z.bfloat16(), w.bfloat16(), 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
