"""torch.autograd.gradcheck in float64, one tiny case per sparse mode and layout."""

from __future__ import annotations

import pytest
import torch

from mcore_npu.ops.reference import npu_fusion_attention
from mcore_npu.tools.cases import load_cases, make_inputs, shrink


def _one_per_mode_and_layout():
    chosen = {}
    for case in load_cases():
        key = (case.layout, case.mode.name)
        if key not in chosen and case.heads_name == "GQA" and case.dtype == "float32":
            tiny = ((2, 3), (0, 0), (3, 3)) if case.layout == "TND" else (4, 5)
            chosen[key] = shrink(case, batch=1, head_dim=3, heads=(2, 1), lengths=tiny)
    return list(chosen.values())


CASES = _one_per_mode_and_layout()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.layout}/{c.mode.name}" for c in CASES])
def test_gradcheck(case):
    inputs = make_inputs(case, dtype=torch.float64)

    def attention(q, k, v):
        return npu_fusion_attention(q, k, v, inputs.head_num, inputs.input_layout,
                                    **inputs.op_kwargs)[0]  # fmt: skip

    assert torch.autograd.gradcheck(attention, (inputs.query, inputs.key, inputs.value))


def test_every_mode_and_layout_is_gradchecked():
    assert {(c.layout, c.mode.sparse_mode) for c in CASES} >= {
        (layout, mode)
        for layout in ("BSH", "SBH", "BSND", "BNSD")
        for mode in (0, 1, 2, 3, 4, 5, 6)
    } | {("TND", mode) for mode in (0, 1, 2, 3, 4, 6, 7, 8)}


def test_pse_gradient_flows_and_matches_finite_differences():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    pse = torch.randn(1, 2, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    from mcore_npu.masks import compressed_causal_mask

    def attention(q, k, pse):
        return npu_fusion_attention(q, k, k, 2, "BNSD", pse=pse, scale=0.5, sparse_mode=3,
                                    atten_mask=compressed_causal_mask())[0]  # fmt: skip

    assert torch.autograd.gradcheck(attention, (q, k, pse))
