"""The references of npu_rms_norm, npu_swiglu and npu_grouped_matmul against float64 oracles.

Each oracle is written independently here (explicit formulas / per-row loops in float64). Forward
and backward (autograd of the reference vs autograd of the oracle), every dtype the operators
take, every documented argument: rms_norm's gamma rank and epsilon, swiglu's dim, grouped
matmul's split_item, group_type (none, 0, 2), group_list_type (cumulative, counts), a 3-D weight,
bias, and experts with zero tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_npu.ops.reference import npu_grouped_matmul, npu_rms_norm, npu_swiglu

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def _rand(*shape, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _leaf(t, dtype):
    return t.detach().to(dtype).requires_grad_(True)


def _close(got, want, dtype):
    torch.testing.assert_close(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype])


# ---------------------------------------------------------------- rms_norm


def _rms_oracle(x, gamma, eps):
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    n = gamma.numel()
    ms = (x * x).sum(dim=dims, keepdim=True) / n
    return x / torch.sqrt(ms + eps) * gamma, 1.0 / torch.sqrt(ms + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, norm_rank, eps",
    [((5, 16), 1, 1e-6), ((2, 3, 8), 1, 1e-5), ((2, 3, 4, 6), 2, 1e-6), ((7,), 1, 0.0),
     ((2, 1, 1, 1, 1, 1, 1, 3), 3, 1e-3)],
)  # fmt: skip
def test_rms_norm_matches_float64_oracle_forward_and_backward(dtype, shape, norm_rank, eps):
    x64 = _rand(*shape, seed=1) * 3
    g64 = _rand(*shape[len(shape) - norm_rank :], seed=2)
    x, g = _leaf(x64, dtype), _leaf(g64, dtype)
    y, rstd = npu_rms_norm(x, g, epsilon=eps)
    xo, go = (
        _leaf(x64.to(dtype).double(), torch.float64),
        _leaf(g64.to(dtype).double(), torch.float64),
    )
    yo, rstdo = _rms_oracle(xo, go, eps)
    assert y.dtype == dtype and y.shape == x.shape
    want_rstd_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert rstd.dtype == want_rstd_dtype
    assert rstd.shape == (*shape[: len(shape) - norm_rank], *[1] * norm_rank)
    _close(y, yo, dtype)
    _close(rstd, rstdo, torch.float32 if dtype != torch.float64 else dtype)
    dy = _rand(*shape, seed=3)
    (y.double() * dy).sum().backward()
    (yo * dy).sum().backward()
    _close(x.grad, xo.grad, dtype)
    _close(g.grad, go.grad, dtype)


def test_rms_norm_default_epsilon_is_1e_6():
    x, g = torch.full((1, 4), 1e-3, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    y, _ = npu_rms_norm(x, g)
    torch.testing.assert_close(y, x / torch.sqrt(torch.tensor(1e-6 + 1e-6, dtype=torch.float64)))


# ---------------------------------------------------------------- swiglu


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, dim", [((4, 10), -1), ((3, 6, 5), 1), ((8, 2, 3), 0),
                                        ((2, 4, 3), -2), ((6,), 0)])  # fmt: skip
def test_swiglu_matches_float64_oracle_forward_and_backward(dtype, shape, dim):
    x64 = _rand(*shape, seed=4) * 2
    x = _leaf(x64, dtype)
    xo = _leaf(x64.to(dtype).double(), torch.float64)
    half = shape[dim] // 2
    a, b = xo.narrow(dim, 0, half), xo.narrow(dim, half, half)
    want = a / (1 + torch.exp(-a)) * b
    got = npu_swiglu(x, dim=dim)
    assert got.dtype == dtype and got.shape == want.shape
    _close(got, want, dtype)
    dy = _rand(*want.shape, seed=5)
    (got.double() * dy).sum().backward()
    (want * dy).sum().backward()
    _close(x.grad, xo.grad, dtype)


def test_swiglu_equals_megatrons_glu_on_the_last_dim():
    x = _rand(3, 8, seed=6, dtype=torch.float32)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    torch.testing.assert_close(npu_swiglu(x), F.silu(x1) * x2, rtol=0, atol=0)


# ---------------------------------------------------------------- grouped matmul


def _cumulative(counts):
    return torch.cumsum(torch.tensor(counts), 0).tolist()


def _split_m_oracle(x, weights, counts, biases=None):
    rows, start = [], 0
    for e, n in enumerate(counts):
        for r in range(start, start + n):  # one row at a time: an independent formula
            out = (x[r].unsqueeze(1) * weights[e]).sum(0)
            rows.append(out + (biases[e] if biases is not None else 0))
        start += n
    return torch.stack(rows) if rows else x.new_zeros(0, weights[0].shape[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 4, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
@pytest.mark.parametrize("group_list_type", [0, 1])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_grouped_matmul_split_m_matches_oracle(dtype, counts, group_list_type, as_tensor):
    x64, w64 = _rand(sum(counts), 6, seed=7), [_rand(6, 5, seed=10 + e) for e in range(4)]
    x, ws = _leaf(x64, dtype), [_leaf(w, dtype) for w in w64]
    group_list = counts if group_list_type == 1 else _cumulative(counts)
    if as_tensor:
        group_list = torch.tensor(group_list, dtype=torch.int64)
    (y,) = npu_grouped_matmul([x], ws, group_list=group_list, group_list_type=group_list_type,
                              split_item=2, group_type=0)  # fmt: skip
    xo = _leaf(x64.to(dtype).double(), torch.float64)
    wo = [_leaf(w.to(dtype).double(), torch.float64) for w in w64]
    want = _split_m_oracle(xo, wo, counts)
    assert y.shape == (sum(counts), 5) and y.dtype == dtype
    _close(y, want, dtype)
    if sum(counts) == 0:
        return
    dy = _rand(*want.shape, seed=8)
    (y.double() * dy).sum().backward()
    (want * dy).sum().backward()
    _close(x.grad, xo.grad, dtype)
    for w, o in zip(ws, wo):
        _close(w.grad, o.grad if o.grad is not None else torch.zeros_like(o), dtype)


@pytest.mark.parametrize("split_item", [0, 1, 2, 3])
def test_grouped_matmul_split_item_chooses_list_or_single_output(split_item):
    counts = [2, 0, 3]
    x, ws = _rand(5, 4, seed=1), [_rand(4, 3, seed=2 + e) for e in range(3)]
    out = npu_grouped_matmul([x], ws, group_list=counts, group_list_type=1,
                             split_item=split_item, group_type=0)  # fmt: skip
    want = _split_m_oracle(x, ws, counts)
    if split_item in (2, 3):
        assert len(out) == 1
        _close(out[0], want, torch.float64)
    else:
        assert [tuple(o.shape) for o in out] == [(2, 3), (0, 3), (3, 3)]
        _close(torch.cat(out), want, torch.float64)


def test_grouped_matmul_takes_one_3d_weight_and_bias():
    counts = [1, 3]
    x, w = _rand(4, 4, seed=3), _rand(2, 4, 6, seed=4)
    bias = [_rand(6, seed=5), _rand(6, seed=6)]
    (y,) = npu_grouped_matmul([x], [w], bias=bias, group_list=_cumulative(counts),
                              split_item=3, group_type=0)  # fmt: skip
    _close(y, _split_m_oracle(x, list(w.unbind(0)), counts, bias), torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [[2, 0, 3], [0, 5, 0]])
@pytest.mark.parametrize("group_list_type", [0, 1])
def test_grouped_matmul_split_k_is_the_per_expert_weight_gradient(dtype, counts, group_list_type):
    # x = [A [m, K]], weight = [B [K, n]]: group e multiplies A's and B's K-slice e.
    a64, b64 = _rand(4, sum(counts), seed=9), _rand(sum(counts), 3, seed=10)
    a, b = _leaf(a64, dtype), _leaf(b64, dtype)
    group_list = counts if group_list_type == 1 else _cumulative(counts)
    (y,) = npu_grouped_matmul([a], [b], group_list=group_list, group_list_type=group_list_type,
                              split_item=3, group_type=2)  # fmt: skip
    ao, bo = (
        _leaf(a64.to(dtype).double(), torch.float64),
        _leaf(b64.to(dtype).double(), torch.float64),
    )
    blocks, start = [], 0
    for n in counts:
        block = torch.zeros(4, 3, dtype=torch.float64)
        for k in range(start, start + n):
            block = block + torch.outer(ao[:, k], bo[k])
        blocks.append(block)
        start += n
    want = torch.stack(blocks)  # [E, m, n]; experts with 0 tokens give zeros
    assert y.shape == (len(counts), 4, 3)
    _close(y, want, dtype)
    dy = _rand(*want.shape, seed=11)
    (y.double() * dy).sum().backward()
    (want * dy).sum().backward()
    _close(a.grad, ao.grad, dtype)
    _close(b.grad, bo.grad, dtype)


@pytest.mark.parametrize("group_type", [None, -1])
@pytest.mark.parametrize("split_item", [0, 3])
def test_grouped_matmul_without_grouping_multiplies_pairs(group_type, split_item):
    xs = [_rand(2, 3, seed=1), _rand(4, 5, seed=2)]
    ws = [_rand(3, 6, seed=3), _rand(5, 6, seed=4)]
    out = npu_grouped_matmul(xs, ws, split_item=split_item, group_type=group_type)
    want = [(x.unsqueeze(2) * w.unsqueeze(0)).sum(1) for x, w in zip(xs, ws)]
    if split_item == 3:
        _close(out[0], torch.cat(want), torch.float64)
    else:
        for o, w in zip(out, want):
            _close(o, w, torch.float64)
