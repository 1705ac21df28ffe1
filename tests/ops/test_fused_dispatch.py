"""The kernel switch of rms_norm / swiglu / grouped_matmul / grouped_linear, and the contract
with torch_npu: a stand-in torch_npu (no NPU here; ``tests/fused_standin.py``) records the calls
and answers with the reference's numbers."""

from __future__ import annotations

import pytest
import torch

from mcore_npu import ops
from mcore_npu.ops.fused import grouped_matmul_keywords
from mcore_npu.ops.reference import npu_grouped_matmul, npu_rms_norm, npu_swiglu
from tests.fused_standin import FusedOpsTorchNpu, install


def test_rms_norm_passes_exactly_x_gamma_epsilon(monkeypatch):
    standin = install(monkeypatch)
    x, g = torch.randn(3, 8), torch.rand(8)
    y = ops.rms_norm(x, g, 1e-5, kernel="torch_npu")
    ((name, args, kwargs),) = standin.calls
    assert name == "npu_rms_norm" and args[0] is x and args[1] is g and kwargs == {"epsilon": 1e-5}
    torch.testing.assert_close(y, npu_rms_norm(x, g, 1e-5)[0], rtol=0, atol=0)


def test_swiglu_passes_exactly_x_and_dim(monkeypatch):
    standin = install(monkeypatch)
    x = torch.randn(3, 8)
    y = ops.swiglu(x, -1, kernel="torch_npu")
    ((name, args, kwargs),) = standin.calls
    assert name == "npu_swiglu" and args[0] is x and kwargs == {"dim": -1}
    torch.testing.assert_close(y, npu_swiglu(x), rtol=0, atol=0)


@pytest.mark.parametrize("op", ["rms_norm", "swiglu"])
def test_auto_runs_the_reference_on_cpu(op, monkeypatch):
    standin = install(monkeypatch)
    x = torch.randn(2, 6)
    out = ops.rms_norm(x, torch.ones(6)) if op == "rms_norm" else ops.swiglu(x)
    assert standin.calls == [] and out.shape[0] == 2


def _expert_problem(counts=(3, 0, 2)):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 4, generator=gen, requires_grad=True)
    ws = [torch.randn(6, 4, generator=gen, requires_grad=True) for _ in counts]
    return x, ws, torch.tensor(counts)


def test_grouped_linear_runs_one_grouped_matmul_per_pass_with_the_documented_arguments(
    monkeypatch,
):
    standin = install(monkeypatch)
    x, ws, counts = _expert_problem()
    y = ops.grouped_linear(x, ws, counts, kernel="torch_npu")
    y.backward(torch.ones_like(y))
    assert standin.names() == ["npu_grouped_matmul"] * 3
    (_, (fx, fw), fk), (_, (bx, bw), bk), (_, (wx, ww), wk) = standin.calls
    common = {"group_list_type": 1}
    assert fk.keys() == {"group_list", "split_item", "group_type", *common}
    assert (fk["split_item"], fk["group_type"], fk["group_list_type"]) == (2, 0, 1)
    assert fx[0] is x and all(torch.equal(a, w.t()) for a, w in zip(fw, ws))
    assert torch.equal(fk["group_list"], counts)
    assert (bk["split_item"], bk["group_type"]) == (2, 0) and torch.equal(bk["group_list"], counts)
    assert all(torch.equal(a, w) for a, w in zip(bw, ws))
    assert (wk["split_item"], wk["group_type"], wk["group_list_type"]) == (3, 2, 1)
    assert torch.equal(wx[0], x.t()) and len(ww) == 1
    want = [x.detach()[s:e] @ w.detach().t() for (s, e), w in zip([(0, 3), (3, 3), (3, 5)], ws)]
    torch.testing.assert_close(y, torch.cat(want))


def test_grouped_linear_gradients_match_autograd_of_the_reference():
    x, ws, counts = _expert_problem((2, 4, 0, 1))
    y = ops.grouped_linear(x, ws, counts, kernel="reference")
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *ws], dy)
    x2, ws2 = x.detach().requires_grad_(), [w.detach().requires_grad_() for w in ws]
    (y2,) = npu_grouped_matmul([x2], [w.t() for w in ws2], group_list=counts.tolist(),
                               group_list_type=1, split_item=2, group_type=0)  # fmt: skip
    want = torch.autograd.grad(y2, [x2, *ws2], dy)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_older_torch_npu_gets_cumulative_group_lists_and_no_new_keywords(monkeypatch):
    standin = install(monkeypatch, old_signature=True)
    x, ws, counts = _expert_problem()
    y = ops.grouped_linear(x, ws, counts, kernel="torch_npu")
    y.sum().backward()
    assert standin.names() == ["npu_grouped_matmul"] * 2  # forward, dX; dW from one mm per expert
    for _, _, kwargs in standin.calls:
        assert "group_type" not in kwargs and "group_list_type" not in kwargs
        assert kwargs["group_list"].tolist() == [3, 3, 5]
    x2, ws2, _ = _expert_problem()
    ops.grouped_linear(x2, ws2, counts, kernel="reference").sum().backward()
    for w, w2 in zip(ws, ws2):
        torch.testing.assert_close(w.grad, w2.grad)


def test_keyword_probe_reads_the_signature():
    new, old = FusedOpsTorchNpu(), FusedOpsTorchNpu(old_signature=True)
    assert {"group_type", "group_list_type", "act_type"} <= grouped_matmul_keywords(
        new.npu_grouped_matmul
    )
    assert "group_type" not in grouped_matmul_keywords(old.npu_grouped_matmul)
    assert "split_item" in grouped_matmul_keywords(old.npu_grouped_matmul)


def test_grouped_matmul_refuses_keywords_the_installed_operator_lacks(monkeypatch):
    install(monkeypatch, old_signature=True)
    with pytest.raises(ValueError, match="cannot run this call: .*takes no \\['group_type'\\]"):
        ops.grouped_matmul([torch.ones(2, 2)], [torch.ones(2, 2)], kernel="torch_npu",
                           group_list=[2], group_type=0)  # fmt: skip


def test_grouped_matmul_refuses_unknown_keywords():
    with pytest.raises(TypeError, match="unknown operator keyword"):
        ops.grouped_matmul([torch.ones(2, 2)], [torch.ones(2, 2)], grouplist=[2])
