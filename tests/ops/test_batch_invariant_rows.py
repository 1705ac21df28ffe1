"""``batch_invariant_linear`` / ``batch_invariant_sum``: the references give every row the same
bits whatever rows surround it, agree with PyTorch's operators and their gradients, refuse bad
shapes naming the argument; the Ascend kernels are vllm-ascend's AscendC library, reached
through ``torch.ops.batch_invariant_ops`` with its schemas (a stand-in library, no NPU here).
``vocab_parallel_log_probs`` on one rank: log_softmax's answer, the same bits for a row alone
or in a batch."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from mcore_npu.ops import batch_invariant_linear, batch_invariant_sum, registry
from mcore_npu.ops.batch_invariant_rows import missing_kernel
from tests import batch_invariant_ops_standin

ROWS = (1, 5, 63, 64, 65, 130, 200)  # across the reference's 64-row blocks


def _data(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, w, b = (torch.randn(*shape, generator=gen) for shape in ((200, 48), (24, 48), (24,)))
    return x.to(dtype), w.to(dtype), b.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gives_a_row_the_same_bits_among_any_rows(dtype):
    x, w, b = _data(dtype)
    full = batch_invariant_linear(x, w, b)
    for n in ROWS:
        assert torch.equal(batch_invariant_linear(x[:n], w, b), full[:n]), n
        assert torch.equal(batch_invariant_linear(x[-n:], w, b), full[-n:]), n
    assert torch.equal(batch_invariant_linear(x.view(8, 25, 48), w, b), full.view(8, 25, 24))


def test_linear_is_fs_linear_with_its_gradients():
    x, w, b = (t.double().requires_grad_() for t in _data())
    got = batch_invariant_linear(x, w, b)
    want = F.linear(x, w, b)
    assert (got - want).abs().max() < 1e-12
    grad = torch.randn_like(want)
    mine = torch.autograd.grad(got, (x, w, b), grad)
    theirs = torch.autograd.grad(want, (x, w, b), grad)
    for a, c in zip(mine, theirs, strict=True):
        assert (a - c).abs().max() < 1e-10


def test_sum_gives_a_row_the_same_bits_and_is_torch_sum():
    x = _data()[0].view(200, 4, 12)
    full = batch_invariant_sum(x, 1)
    assert full.shape == (200, 12) and (full - x.sum(1)).abs().max() < 1e-5
    for n in ROWS:
        assert torch.equal(batch_invariant_sum(x[:n], 1), full[:n]), n
    kept = batch_invariant_sum(x, -1, keepdim=True)
    assert kept.shape == (200, 4, 1) and (kept - x.sum(-1, keepdim=True)).abs().max() < 1e-5
    leaf = x.double().requires_grad_()
    (grad,) = torch.autograd.grad(batch_invariant_sum(leaf, 2).square().sum(), leaf)
    assert torch.allclose(grad, 2 * leaf.sum(2, keepdim=True).expand_as(leaf))


def test_bad_calls_name_the_argument():
    x, w, b = _data()
    with pytest.raises(ValueError, match="weight must be \\[N, K\\]"):
        batch_invariant_linear(x, w.t())
    with pytest.raises(ValueError, match="bias must be \\[N\\]"):
        batch_invariant_linear(x, w, b[:3])
    with pytest.raises(TypeError, match="dim must be one int"):
        batch_invariant_sum(x, (0, 1))
    with pytest.raises(ValueError, match="dim 2 is outside"):
        batch_invariant_sum(x, 2)
    with pytest.raises(ValueError, match="unknown kernel 'torch_npu'"):
        batch_invariant_linear(x, w, kernel="torch_npu")  # its Ascend kernel is the library


def test_the_library_asked_for_by_name_without_it_raises_naming_the_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "batch_invariant_ops", None)  # its import fails
    x, w, _ = _data()
    with pytest.raises(ImportError, match="VLLM_BATCH_INVARIANT=1"):
        batch_invariant_linear(x, w, kernel="batch_invariant_ops")
    message = missing_kernel(True)
    assert message.startswith("batch-invariant mode on an NPU needs batch_invariant_ops ")
    assert "\n" not in message and missing_kernel(False) is None
    with pytest.warns(UserWarning, match="batch_invariant_sum: using the PyTorch reference"):
        reason = registry.resolve("batch_invariant_sum", "auto", "npu").reasons[0]
    assert reason.startswith("batch_invariant_ops: ")


def test_on_the_stand_in_library_the_calls_are_its_operators_with_their_schemas(monkeypatch):
    library = batch_invariant_ops_standin.install(monkeypatch)
    assert missing_kernel(True) is None
    x, w, b = _data()
    got = batch_invariant_linear(x.view(10, 20, 48), w, b, kernel="batch_invariant_ops")
    total = batch_invariant_sum(x, 0, True, kernel="batch_invariant_ops")
    assert torch.equal(got.view(200, 24), batch_invariant_linear(x, w, b, kernel="reference"))
    assert torch.equal(total, batch_invariant_sum(x, 0, True, kernel="reference"))
    (name, (a, other)), (name_sum, (y, dim, keepdim)) = library.calls
    assert name == "npu_matmul_batch_invariant" and name_sum == "npu_reduce_sum_batch_invariant"
    assert a.shape == (200, 48) and other.shape == (48, 24)  # x rows @ weight^T
    assert y.shape == (48, 200) and dim == 1 and keepdim is False  # rows: the summed dim last


def test_vocab_parallel_log_probs_on_one_rank_is_log_softmax_and_row_invariant():
    from mcore_npu.transformer.vocab_parallel import vocab_parallel_log_probs

    gen = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(3, 70, 96, generator=gen)).requires_grad_()
    labels = torch.randint(0, 96, (3, 70), generator=gen)
    got = vocab_parallel_log_probs(logits, labels)
    want = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None])[..., 0]
    assert got.dtype == torch.float32 and (got - want).abs().max() < 1e-5
    (grad,) = torch.autograd.grad(got.sum(), logits)
    (expected,) = torch.autograd.grad(want.sum(), logits)
    assert (grad - expected).abs().max() < 1e-5
    with torch.no_grad():
        for row in range(3):
            alone = vocab_parallel_log_probs(logits[row, :33], labels[row, :33])
            assert torch.equal(alone, got[row, :33].detach())
