"""Per-expert biases through ``grouped_linear``: forward hands them to ``npu_grouped_matmul`` as
its ``bias`` list; backward computes their gradients (the column sums of each expert's rows of
dY). A stand-in torch_npu (no NPU here; ``tests/fused_standin.py``) records the calls and
answers with the reference's numbers."""

from __future__ import annotations

import pytest
import torch

from mcore_npu import ops
from mcore_npu.ops.reference import npu_grouped_matmul
from tests.fused_standin import install


def _problem(counts=(3, 0, 2), dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 4, generator=gen, dtype=dtype, requires_grad=True)
    ws = [torch.randn(6, 4, generator=gen, dtype=dtype, requires_grad=True) for _ in counts]
    bs = [torch.randn(6, generator=gen, dtype=dtype, requires_grad=True) for _ in counts]
    return x, ws, bs, torch.tensor(counts)


def test_forward_passes_the_bias_list_and_backward_does_not(monkeypatch):
    standin = install(monkeypatch)
    x, ws, bs, counts = _problem()
    y = ops.grouped_linear(x, ws, counts, biases=bs, kernel="torch_npu")
    y.backward(torch.ones_like(y))
    assert standin.names() == ["npu_grouped_matmul"] * 3
    (_, _, forward), (_, _, grad_x), (_, _, grad_w) = standin.calls
    assert len(forward["bias"]) == 3 and all(a is b for a, b in zip(forward["bias"], bs))
    assert (forward["split_item"], forward["group_type"]) == (2, 0)
    assert "bias" not in grad_x and "bias" not in grad_w
    want = [x.detach()[s:e] @ w.detach().t() + b.detach()
            for (s, e), w, b in zip([(0, 3), (3, 3), (3, 5)], ws, bs)]  # fmt: skip
    torch.testing.assert_close(y, torch.cat(want))
    torch.testing.assert_close(bs[0].grad, torch.full((6,), 3.0))  # 3 rows of ones
    torch.testing.assert_close(bs[1].grad, torch.zeros(6))  # no rows
    torch.testing.assert_close(bs[2].grad, torch.full((6,), 2.0))


def test_older_torch_npu_gets_the_bias_list_too(monkeypatch):
    standin = install(monkeypatch, old_signature=True)
    x, ws, bs, counts = _problem()
    ops.grouped_linear(x, ws, counts, biases=bs, kernel="torch_npu").sum().backward()
    forward = standin.calls[0][2]
    assert all(a is b for a, b in zip(forward["bias"], bs))
    assert bs[2].grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gradients_match_autograd_of_the_reference(dtype):
    x, ws, bs, counts = _problem((2, 4, 0, 1), dtype)
    y = ops.grouped_linear(x, ws, counts, biases=bs, kernel="reference")
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *ws, *bs], dy)
    leaves = [t.detach().requires_grad_() for t in (x, *ws, *bs)]
    x2, ws2, bs2 = leaves[0], leaves[1:5], leaves[5:]
    (y2,) = npu_grouped_matmul([x2], [w.t() for w in ws2], bias=bs2, group_list=counts.tolist(),
                               group_list_type=1, split_item=2, group_type=0)  # fmt: skip
    want = torch.autograd.grad(y2, leaves, dy)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)


def test_bias_count_must_match_the_weights():
    x, ws, bs, counts = _problem()
    with pytest.raises(ValueError, match="biases: 2 biases for 3 weights"):
        ops.grouped_linear(x, ws, counts, biases=bs[:2], kernel="reference")


def test_grouped_experts_send_fc1_biases_to_the_operator(monkeypatch):
    """NPUGroupedMLP with biases: the fc1 call carries its biases; the fc2 bias is scaled by
    each row's probability, so it is added after the call (as Megatron's experts do)."""
    from types import SimpleNamespace

    from mcore_npu.transformer.experts import NPUGroupedMLP
    from tests.transformer.megatron_models import tiny_config
    from tests.transformer.test_experts import _Group

    config = tiny_config(num_moe_experts=2, moe_router_topk=2, moe_ffn_hidden_size=8,
                         add_bias_linear=True)  # fmt: skip
    groups = SimpleNamespace(ep=_Group(0, 1), expt_tp=_Group(0, 1), expt_dp=_Group(0, 1))
    experts = NPUGroupedMLP(2, config, pg_collection=groups, kernel="torch_npu")
    standin = install(monkeypatch)
    out, _ = experts(torch.randn(5, 64), torch.tensor([2, 3]), torch.rand(5))
    out.sum().backward()
    grouped = [kwargs for name, _, kwargs in standin.calls if name == "npu_grouped_matmul"]
    forward_fc1, forward_fc2 = grouped[0], grouped[1]
    assert [b is e for b, e in zip(forward_fc1["bias"], experts.fc1_biases())] == [True, True]
    assert "bias" not in forward_fc2
    assert all(b.grad is not None and b.grad.abs().sum() > 0 for b in experts.fc2_biases())
