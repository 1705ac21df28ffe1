"""The reference npu_fusion_attention_grad against autograd through the forward reference.

float64, one case per layout and sparse mode from the case table, GQA. With the forward's own
statistics (float32, as the operator stores them) the gradients agree to float32 precision;
with the statistics recomputed (None) to float64 precision. Each runs twice: with the
shipped tile sizes (one tile at these lengths) and with tiles of one query row x two keys, so
that the tiling, the causal tiles skipped above the diagonal and pse's tiles are exercised.
"""

from __future__ import annotations

import pytest
import torch

from mcore_npu.ops import attention_grad
from mcore_npu.ops.reference import npu_fusion_attention, npu_fusion_attention_grad
from mcore_npu.tools.cases import load_cases, make_inputs, shrink


def _one_per_mode_and_layout():
    """One case per layout and mode (GQA), and one per layout and mode of the table's
    ``value_head_dim`` section (MLA's Dv < D: MHA, head dims 4 and 2)."""
    chosen = {}
    for case in load_cases():
        lengths = ((5, 7), (0, 0), (6, 6)) if case.layout == "TND" else (6, 9)
        if case.head_dim_v is not None:
            key = (case.layout, case.mode.name, "Dv")
            if key not in chosen and case.dtype == "float32":
                chosen[key] = shrink(case, batch=2, head_dim=4, head_dim_v=2, lengths=lengths)
            continue
        key = (case.layout, case.mode.name)
        if key not in chosen and case.heads_name == "GQA" and case.dtype == "float32":
            chosen[key] = shrink(case, batch=2, head_dim=4, heads=(4, 2), lengths=lengths)
    return list(chosen.values())


CASES = _one_per_mode_and_layout()


@pytest.fixture(params=["shipped tiles", "1x2 tiles"])
def tiles(request, monkeypatch):
    """The gradient reference's tile sizes: as shipped, or one query row by two keys."""
    if request.param == "1x2 tiles":
        monkeypatch.setattr(attention_grad, "KEY_BLOCK", 2)
        monkeypatch.setattr(attention_grad, "GRAD_BLOCK_BYTES", 1)
    return request.param


def _autograd(inputs, dy):
    q, k, v = (t.detach().requires_grad_() for t in (inputs.query, inputs.key, inputs.value))
    out, smax, ssum, *_ = npu_fusion_attention(
        q, k, v, inputs.head_num, inputs.input_layout, **inputs.op_kwargs
    )
    out.backward(dy)
    return out.detach(), smax, ssum, (q.grad, k.grad, v.grad)


def _grad_kwargs(inputs):
    kwargs = dict(inputs.op_kwargs)
    kwargs["scale_value"] = kwargs.pop("scale", 1.0)
    return kwargs


@pytest.mark.parametrize("case", CASES, ids=[
    f"{c.layout}/{c.mode.name}" + ("/Dv" if c.head_dim_v else "") for c in CASES])  # fmt: skip
def test_grad_matches_autograd(case, tiles):
    inputs = make_inputs(case, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    out0 = npu_fusion_attention(inputs.query, inputs.key, inputs.value, inputs.head_num,
                                inputs.input_layout, **inputs.op_kwargs)[0]  # fmt: skip
    dy = torch.randn(out0.shape, generator=gen, dtype=torch.float64)
    out, smax, ssum, want = _autograd(inputs, dy)
    args = (inputs.query, inputs.key, inputs.value, dy, inputs.head_num, inputs.input_layout)
    given = npu_fusion_attention_grad(
        *args, softmax_max=smax, softmax_sum=ssum, attention_in=out, **_grad_kwargs(inputs)
    )
    recomputed = npu_fusion_attention_grad(*args, **_grad_kwargs(inputs))
    for name, w, g, r in zip(("dq", "dk", "dv"), want, given, recomputed):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        torch.testing.assert_close(r, w, rtol=1e-9, atol=1e-10, msg=name)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
    assert given[3].numel() == 0  # no pse: empty dpse


def test_value_head_dim_below_head_dim_is_covered_in_every_layout():
    dv = {(c.layout, c.mode.sparse_mode) for c in CASES if c.head_dim_v is not None}
    assert {layout for layout, _ in dv} == {"BSH", "SBH", "BSND", "BNSD", "TND"}
    assert {mode for _, mode in dv} == {0, 1, 2, 3}
    assert all(c.value_dim < c.head_dim for c in CASES if c.head_dim_v is not None)


def test_every_mode_and_layout_is_covered():
    assert {(c.layout, c.mode.sparse_mode) for c in CASES} >= {
        (layout, mode)
        for layout in ("BSH", "SBH", "BSND", "BNSD")
        for mode in (0, 1, 2, 3, 4, 5, 6)
    } | {("TND", mode) for mode in (0, 1, 2, 3, 4, 6, 7, 8)}


@pytest.mark.parametrize("pse_shape", [(2, 2, 4, 5), (2, 2, 1, 5), (1, 2, 4, 5)])
def test_pse_gradient(pse_shape, tiles):
    from mcore_npu.masks import compressed_causal_mask

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 4, 3, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 1, 5, 3, generator=gen, dtype=torch.float64)
    pse = torch.randn(pse_shape, generator=gen, dtype=torch.float64, requires_grad=True)
    kw = dict(sparse_mode=3, atten_mask=compressed_causal_mask())
    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    out = npu_fusion_attention(qa, ka, ka, 2, "BNSD", pse=pse, scale=0.5, **kw)[0]
    dy = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(dy)
    dq, dk, dv, dpse = npu_fusion_attention_grad(q, k, k, dy, 2, "BNSD", pse=pse.detach(),
                                                 scale_value=0.5, **kw)  # fmt: skip
    torch.testing.assert_close(dq, qa.grad)
    torch.testing.assert_close(dk + dv, ka.grad)  # key is value: both paths add up
    torch.testing.assert_close(dpse, pse.grad)


def test_small_tiles_skip_the_tiles_above_a_causal_diagonal(monkeypatch):
    """Rows 0..5 x keys 0..5 causal in tiles of 1 row x 2 keys: row i visits key blocks up to
    its own, i // 2 + 1 of 3, the rest is skipped."""
    from mcore_npu.ops.attention_reference import _Keep

    monkeypatch.setattr(attention_grad, "KEY_BLOCK", 2)
    keep = _Keep(causal=True)
    tiles = attention_grad._Tiles(keep, 6, 6, row_bytes=1 << 30)
    visited = {}
    for start, stop in tiles.row_blocks():
        rows = keep.rows(start, stop, 6, "cpu")
        visited[start] = [(k0, mask is None) for k0, _, mask in tiles.key_blocks(start, stop, rows)]
    assert visited == {
        0: [(0, False)], 1: [(0, True)], 2: [(0, True), (2, False)], 3: [(0, True), (2, True)],
        4: [(0, True), (2, True), (4, False)], 5: [(0, True), (2, True), (4, True)],
    }  # fmt: skip


def test_refusals_name_the_argument():
    q = k = v = torch.randn(1, 4, 8)
    good = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="dy"):
        npu_fusion_attention_grad(q, k, v, good[:, :3], 2, "BSH")
    with pytest.raises(ValueError, match="softmax_max / softmax_sum"):
        npu_fusion_attention_grad(q, k, v, good, 2, "BSH", softmax_max=torch.zeros(1, 2, 4, 8))
    with pytest.raises(ValueError, match="softmax_sum"):
        npu_fusion_attention_grad(q, k, v, good, 2, "BSH", softmax_max=torch.zeros(1, 2, 4, 8),
                                  softmax_sum=torch.zeros(1, 2, 3, 8))  # fmt: skip
    with pytest.raises(NotImplementedError, match="keep_prob"):
        npu_fusion_attention_grad(q, k, v, good, 2, "BSH", keep_prob=0.9)
    with pytest.raises(ValueError, match="head_num"):
        npu_fusion_attention_grad(q, k, v, good, 0, "BSH")


def test_empty_key_gives_zero_output_and_documented_statistics():
    q = torch.randn(2, 3, 4 * 8)
    k = v = torch.randn(2, 0, 2 * 8)
    out, smax, ssum, *_ = npu_fusion_attention(q, k, v, 4, "BSH", scale=0.3)
    assert out.shape == q.shape and not out.any()
    assert smax.shape == ssum.shape == (2, 4, 3, 8)
    assert (smax == torch.finfo(torch.float32).min).all()
    assert (ssum == torch.finfo(torch.float32).max).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["SBH", "BSND"])
def test_grad_in_the_input_dtype_and_layout(layout, dtype):
    """float32 inputs are written through [B, N, S, D] views into buffers of their own layout;
    bfloat16/float16 are computed in float32 and converted. Both equal the float64 result to
    the input dtype's precision, in the input's dtype and shape."""
    case = next(c for c in CASES if c.layout == layout and c.mode.sparse_mode == 2)
    inputs = make_inputs(case, dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    q, k, v = (t.to(dtype) for t in (inputs.query, inputs.key, inputs.value))
    dy = torch.randn(q.shape, generator=gen).to(dtype)  # Dv = D: the output has q's shape
    want = npu_fusion_attention_grad(
        *(t.double() for t in (q, k, v, dy)), inputs.head_num, layout, **_grad_kwargs(inputs)
    )
    got = npu_fusion_attention_grad(q, k, v, dy, inputs.head_num, layout, **_grad_kwargs(inputs))
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for name, w, g, x in zip(("dq", "dk", "dv"), want, got, (q, k, v)):
        assert g.dtype == dtype and g.shape == x.shape, name
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol, msg=name)
