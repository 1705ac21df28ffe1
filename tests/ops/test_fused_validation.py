"""Bad inputs of the fused operators: each raises TypeError/ValueError naming the argument.

The same checks run before either kernel (``mcore_npu.ops.npu_rms_norm`` / ``npu_swiglu`` /
``grouped_matmul`` dispatch them for torch_npu too), so each case is also run through the dispatch
with ``kernel="torch_npu"`` and a stand-in torch_npu that must not be called.
"""

from __future__ import annotations

import pytest
import torch

from mcore_npu import ops
from mcore_npu.ops.reference import npu_grouped_matmul, npu_rms_norm, npu_swiglu
from tests.fused_standin import install

X = torch.randn(4, 8)
G = torch.ones(8)

RMS_CASES = [  # (x, gamma, epsilon, exception, argument named)
    ([1.0] * 8, G, 1e-6, TypeError, "self"),
    (X, [1.0] * 8, 1e-6, TypeError, "gamma"),
    (X.int(), G, 1e-6, TypeError, "self"),
    (X, G.double(), 1e-6, TypeError, "gamma"),
    (torch.tensor(1.0), torch.ones(()), 1e-6, ValueError, "self"),
    (torch.ones([1] * 9), torch.ones(1), 1e-6, ValueError, "self"),
    (X, torch.ones(()), 1e-6, ValueError, "gamma"),
    (X, torch.ones(2, 4, 8), 1e-6, ValueError, "gamma"),
    (X, torch.ones(4), 1e-6, ValueError, "gamma"),
    (X, torch.ones(4, 4), 1e-6, ValueError, "gamma"),
    (torch.ones(4, 0), torch.ones(0), 1e-6, ValueError, "gamma"),
    (X, G, "1e-6", TypeError, "epsilon"),
    (X, G, True, TypeError, "epsilon"),
    (X, G, -1e-6, ValueError, "epsilon"),
    (X, G, float("nan"), ValueError, "epsilon"),
    (X, G, float("inf"), ValueError, "epsilon"),
]


@pytest.mark.parametrize("x, gamma, eps, exc, argument", RMS_CASES)
def test_rms_norm_refuses_naming_the_argument(x, gamma, eps, exc, argument, monkeypatch):
    with pytest.raises(exc, match=rf"^npu_rms_norm: {argument}: (.|\n)*fix: "):
        npu_rms_norm(x, gamma, eps)
    standin = install(monkeypatch)
    with pytest.raises(exc, match=rf"npu_rms_norm: {argument}:"):
        ops.rms_norm(x, gamma, eps, kernel="torch_npu")
    assert standin.calls == []


def test_rms_norm_float64_is_for_the_reference_only(monkeypatch):
    install(monkeypatch)
    ops.rms_norm(X.double(), G.double(), kernel="reference")
    with pytest.raises(TypeError, match="self: dtype torch.float64 .*reference kernel only"):
        ops.rms_norm(X.double(), G.double(), kernel="torch_npu")


SWIGLU_CASES = [  # (x, dim, exception, argument)
    ("x", -1, TypeError, "self"),
    (X.long(), -1, TypeError, "self"),
    (X.bool(), -1, TypeError, "self"),
    (torch.tensor(2.0), 0, ValueError, "self"),
    (torch.ones([2] * 9), -1, ValueError, "self"),
    (X, 1.0, TypeError, "dim"),
    (X, True, TypeError, "dim"),
    (X, "last", TypeError, "dim"),
    (X, 2, ValueError, "dim"),
    (X, -3, ValueError, "dim"),
    (torch.ones(4, 7), -1, ValueError, "self"),
    (torch.ones(3, 8), 0, ValueError, "self"),
]


@pytest.mark.parametrize("x, dim, exc, argument", SWIGLU_CASES)
def test_swiglu_refuses_naming_the_argument(x, dim, exc, argument, monkeypatch):
    with pytest.raises(exc, match=rf"^npu_swiglu: {argument}: (.|\n)*fix: "):
        npu_swiglu(x, dim)
    standin = install(monkeypatch)
    with pytest.raises(exc, match=rf"npu_swiglu: {argument}:"):
        ops.swiglu(x, dim, kernel="torch_npu")
    assert standin.calls == []


GX = torch.randn(5, 4)
GW = [torch.randn(4, 3) for _ in range(2)]
OK = dict(group_list=[2, 3], group_list_type=1, split_item=2, group_type=0)
GMM_CASES = [  # (x, weight, keyword changes, exception, argument)
    (GX, GW, {}, TypeError, "x"),
    ([GX], GW[0], {}, TypeError, "weight"),
    ([], GW, {}, TypeError, "x"),
    ([GX.int()], GW, {}, TypeError, r"x\[0\]"),
    ([GX], [GW[0], GW[1].double()], {}, TypeError, r"weight\[1\]"),
    ([GX.reshape(5, 2, 2)], GW, {}, ValueError, r"x\[0\]"),
    ([GX], [torch.randn(4)] * 2, {}, ValueError, r"weight\[0\]"),
    ([GX], [torch.randn(3, 3)] * 2, {}, ValueError, "weight"),
    ([GX], [GW[0], torch.randn(4, 2)], {}, ValueError, "weight"),
    ([GX, GX], GW, {}, ValueError, "x"),
    ([GX], GW, {"group_list": None}, ValueError, "group_list"),
    ([GX], GW, {"group_list": [2, 2]}, ValueError, "group_list"),
    ([GX], GW, {"group_list": [5]}, ValueError, "group_list"),
    ([GX], GW, {"group_list": [6, -1]}, ValueError, "group_list"),
    ([GX], GW, {"group_list": [3, 2], "group_list_type": 0}, ValueError, "group_list"),
    ([GX], GW, {"group_list": [2, 4], "group_list_type": 0}, ValueError, "group_list"),
    ([GX], GW, {"group_list": torch.tensor([2.0, 3.0])}, TypeError, "group_list"),
    ([GX], GW, {"group_list": "2,3"}, TypeError, "group_list"),
    ([GX], GW, {"group_list_type": 2}, ValueError, "group_list_type"),
    ([GX], GW, {"split_item": 4}, ValueError, "split_item"),
    ([GX], GW, {"split_item": 2.0}, TypeError, "split_item"),
    ([GX], GW, {"group_type": 1}, ValueError, "group_type"),
    ([GX], GW, {"group_type": "m"}, TypeError, "group_type"),
    ([GX], GW, {"act_type": 1}, ValueError, "act_type"),
    ([GX], GW, {"output_dtype": torch.float16}, ValueError, "output_dtype"),
    ([GX], GW, {"scale": [torch.ones(3)]}, ValueError, "scale"),
    ([GX], GW, {"per_token_scale": [torch.ones(5)]}, ValueError, "per_token_scale"),
    ([GX], GW, {"bias": [torch.ones(3)]}, TypeError, "bias"),
    ([GX], GW, {"bias": [torch.ones(4)] * 2}, ValueError, r"bias\[0\]"),
    ([GX], GW, {"group_type": None}, ValueError, "group_list"),
    (
        [GX.t()],
        [torch.randn(5, 3)],
        {"group_type": 2, "group_list": [1, 1]},
        ValueError,
        "group_list",
    ),
    ([GX.t()], GW, {"group_type": 2}, ValueError, "weight"),
]


@pytest.mark.parametrize("x, weight, changes, exc, argument", GMM_CASES)
def test_grouped_matmul_refuses_naming_the_argument(x, weight, changes, exc, argument, monkeypatch):
    kwargs = {**OK, **changes}
    with pytest.raises(exc, match=rf"^npu_grouped_matmul: {argument}: (.|\n)*fix: "):
        npu_grouped_matmul(x, weight, **kwargs)
    standin = install(monkeypatch)
    with pytest.raises(exc, match=rf"npu_grouped_matmul: {argument}:"):
        ops.grouped_matmul(x, weight, kernel="torch_npu", **kwargs)
    assert standin.calls == []


def test_the_valid_baseline_of_the_grouped_cases_passes():
    (y,) = npu_grouped_matmul([GX], GW, **OK)
    assert y.shape == (5, 3)
