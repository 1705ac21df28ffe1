"""The whole case table (specs/attention_cases.yaml): the reference against the float64 oracle.

Forward and gradients are compared on rows that keep at least one key, within the table's
tolerance for the dtype; invalid (fully masked) rows are checked separately: output exactly 0,
query gradient exactly 0, every gradient finite.
"""

from __future__ import annotations

import pytest
import torch

from mcore_npu.ops.reference import npu_fusion_attention
from mcore_npu.tools.cases import load_cases, make_inputs
from tests.ops.oracle import oracle

CASES = load_cases()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: thread start-up would cost more than the math (19 s vs 3 s in a trial)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_table_covers_every_layout_mode_grouping_length_and_dtype():
    layouts = {c.layout for c in CASES}
    assert layouts == {"BSH", "SBH", "BSND", "BNSD", "TND"}
    for layout in layouts:
        modes = {c.mode.sparse_mode for c in CASES if c.layout == layout}
        expected = {0, 1, 2, 3, 4, 6, 7, 8} if layout == "TND" else {0, 1, 2, 3, 4, 5, 6}
        assert modes == expected, layout
    assert {c.heads_name for c in CASES} == {"MHA", "GQA", "MQA"}
    assert {c.lengths_name for c in CASES} == {"equal", "q_shorter", "q_longer"}
    assert {c.dtype for c in CASES} == {"float32", "bfloat16", "float16"}
    assert len(CASES) > 1000


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reference_matches_oracle(case):
    inputs = make_inputs(case)
    out = npu_fusion_attention(*inputs.call_args(), **inputs.op_kwargs)[0]
    leaves = [
        t.detach().double().requires_grad_() for t in (inputs.query, inputs.key, inputs.value)
    ]
    want, valid = oracle(*leaves, inputs.head_num, inputs.input_layout, **inputs.op_kwargs)
    assert out.shape == want.shape and out.dtype == case.torch_dtype

    grad_out = torch.randn(want.shape, generator=torch.Generator().manual_seed(7))
    grad_out = grad_out.to(case.torch_dtype)
    out.backward(grad_out)
    want.backward(grad_out.double())

    _assert_close(out.double(), want, valid, case.forward, "output")
    assert torch.all(out[~valid] == 0), "invalid rows must be exactly 0"
    q_valid = _rows_of(valid, inputs, like=inputs.query)
    for name, got, ref, rows in (
        ("dq", inputs.query.grad, leaves[0].grad, q_valid),
        ("dk", inputs.key.grad, leaves[1].grad, None),
        ("dv", inputs.value.grad, leaves[2].grad, None),
    ):
        assert torch.isfinite(got).all(), f"{name} has NaN/inf"
        _assert_close(got.double(), ref, rows, case.grad, name)
    assert torch.all(inputs.query.grad[~q_valid] == 0), "invalid rows must get zero dq"


def _assert_close(got, want, valid, tol, what):
    if valid is not None:
        got, want = got[valid], want[valid]
    if want.numel() == 0:
        return
    err = (got - want).abs().max().item()
    bound = tol.bound(want.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


def _rows_of(valid_out, inputs, like):
    """Row validity in the query's shape (the output has Dv, the query D features)."""
    if valid_out.shape == like.shape:
        return valid_out
    layout = inputs.input_layout
    if layout in ("BSH", "SBH"):
        heads = inputs.head_num
        per_head = valid_out.unflatten(-1, (heads, -1))[..., :1]
        return per_head.expand(*per_head.shape[:-1], like.shape[-1] // heads).flatten(-2)
    return valid_out[..., :1].expand(like.shape)
