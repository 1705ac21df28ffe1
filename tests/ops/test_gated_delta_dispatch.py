"""chunk_gated_delta_rule: argument checks, the kernel choice and the contracts with the Ascend
kernels. We have no NPU: ``tests/gated_delta_standin.py`` puts stand-in ``torch_npu``, ``fla``
and ``fla_npu`` modules into ``sys.modules`` that record their calls (see there what each
computes)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mcore_npu.ops.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    fla_npu_chain,
    gated_rms_norm,
    l2norm,
)
from mcore_npu.ops.gated_delta.rule import choose_kernel
from tests.gated_delta_standin import install_fla, install_fla_npu, install_torch_npu


def _problem(t=70, b=1, h=1, hv=2, dk=16, dv=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, hv, dv, generator=gen)
    g = -torch.rand(b, t, hv, generator=gen)
    beta = torch.rand(b, t, hv, generator=gen)
    return [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype)]


# ------------------------------------------------------------------ argument checks


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (lambda a: a.update(q=a["q"].long()), TypeError, ["q:", "int64", "fix:"]),
        (lambda a: a.update(k=a["k"][..., :4]), ValueError, ["k:", "[1, 9, 2, 4]", "fix:"]),
        (lambda a: a.update(v=a["v"][:, :, :3]), ValueError, ["v:", "3 value heads", "multiple"]),
        (lambda a: a.update(g=a["g"][..., :1]), ValueError, ["g:", "[1, 9, 1]", "fix:"]),
        (lambda a: a.update(beta=a["beta"][0]), ValueError, ["beta:", "rank 2", "[B, T, HV]"]),
        (lambda a: a.update(scale=-1.0), ValueError, ["scale:", "-1.0", "fix:"]),
        (lambda a: a.update(scale="0.5"), TypeError, ["scale:", "str", "fix:"]),
        (lambda a: a.update(output_final_state=1), TypeError, ["output_final_state:", "bool"]),
        (lambda a: a.update(use_qk_l2norm_in_kernel="yes"), TypeError,
         ["use_qk_l2norm_in_kernel:", "bool"]),
        (lambda a: a.update(initial_state=torch.zeros(1, 4, 16, 8)), ValueError,
         ["initial_state:", "[1, 4, 16, 8]", "[1, 4, 8, 8]"]),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 4, 8])), ValueError,
         ["cu_seqlens:", "[0, 4, 8]", "T = 9"]),
        (lambda a: a.update(cu_seqlens=torch.tensor([0.0, 9.0])), TypeError,
         ["cu_seqlens:", "integer"]),
        (lambda a: a.update(kernel="npu"), ValueError, ["kernel:", "'npu'", "auto"]),
    ],
)  # fmt: skip
def test_bad_arguments_name_the_argument_the_value_and_the_fix(change, exc, words):
    q, k, v, g, beta = _problem(t=9, h=2, hv=4, dk=8)
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    change(args)
    with pytest.raises(exc) as info:
        chunk_gated_delta_rule(**args)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_packed_needs_batch_one_and_one_initial_state_per_segment():
    q, k, v, g, beta = _problem(t=9, b=2)
    with pytest.raises(ValueError, match="cu_seqlens: packed segments need batch 1, got B = 2"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 9]))
    q, k, v, g, beta = _problem(t=9)
    with pytest.raises(ValueError, match=r"initial_state: shape \[1, 2, 16, 8\], expected "
                       r"\[2, 2, 16, 8\] \(\[N = len\(cu_seqlens\) - 1 segments"):  # fmt: skip
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 9]),
                               initial_state=torch.zeros(1, 2, 16, 8))  # fmt: skip


def test_companion_operators_check_their_arguments():
    with pytest.raises(ValueError, match=r"causal_conv1d: weight: shape \[6, 1, 4\], expected "
                       r"\[5, 1, W\]"):  # fmt: skip
        causal_conv1d(torch.zeros(1, 3, 5), torch.zeros(6, 1, 4))
    with pytest.raises(ValueError, match="causal_conv1d: cu_seqlens"):
        causal_conv1d(torch.zeros(1, 3, 5), torch.zeros(5, 1, 4), cu_seqlens=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"gated_rms_norm: weight: shape \[4\], expected \[8\]"):
        gated_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(4))
    with pytest.raises(TypeError, match="l2norm: x: dtype torch.int64"):
        l2norm(torch.zeros(2, 8, dtype=torch.long))


# ------------------------------------------------------------------ the choice of kernel


def _on_npu(*tensors):
    """Shape/dtype holders on a stand-in NPU device (torch.device('npu') needs torch_npu)."""
    return [types.SimpleNamespace(device=types.SimpleNamespace(type="npu"), dtype=t.dtype,
                                  shape=t.shape) for t in tensors]  # fmt: skip


def test_auto_picks_the_reference_off_the_npu_even_with_kernels_installed(monkeypatch):
    calls = [install_torch_npu(monkeypatch), install_fla(monkeypatch), install_fla_npu(monkeypatch)]
    q, k, v, g, beta = _problem(dtype=torch.bfloat16, dk=128, dv=128)
    with torch.no_grad():
        chunk_gated_delta_rule(q, k, v, g, beta)
    assert all(rec.calls == [] for rec in calls)


def test_auto_on_the_npu_prefers_forward_only_then_fla_npu_then_fla_then_reference(monkeypatch):
    q, _, v, *_ = _problem(dtype=torch.bfloat16, dk=128, dv=128)
    nq, nv = _on_npu(q, v)
    assert choose_kernel("auto", nq, nv, grad=False) == "reference"  # nothing installed here
    install_fla(monkeypatch)
    assert choose_kernel("auto", nq, nv, grad=True) == "fla"
    install_fla_npu(monkeypatch)
    assert choose_kernel("auto", nq, nv, grad=True) == "fla_npu"
    assert choose_kernel("auto", nq, nv, grad=True, output_final_state=True) == "fla"
    install_torch_npu(monkeypatch)
    assert choose_kernel("auto", nq, nv, grad=False) == "torch_npu"
    assert choose_kernel("auto", nq, nv, grad=True) == "fla_npu"
    q32, v32 = _on_npu(q.float(), v.float())  # fp32: neither Ascend C kernel takes it
    assert choose_kernel("auto", q32, v32, grad=False) == "fla"
    small_q, small_v = _on_npu(*_problem(dtype=torch.bfloat16)[::2][:2])  # K 16, V 8
    assert choose_kernel("auto", small_q, small_v, grad=True) == "fla"


def test_a_broken_kernel_import_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # import raises
    monkeypatch.setitem(sys.modules, "fla_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    q, _, v, *_ = _problem()
    assert choose_kernel("auto", *_on_npu(q, v), grad=True) == "reference"
    with pytest.raises(ImportError, match="fla: failed to import.*\n.*flash-linear-attention"):
        chunk_gated_delta_rule(*_problem(), kernel="fla")


# ------------------------------------------------------------------ contracts


def test_torch_npu_forward_only_gets_tnd_and_transposed_states(monkeypatch):
    rec = install_torch_npu(monkeypatch)
    q, k, v, g, beta = _problem(t=40, b=2, h=1, hv=2, dk=128, dv=128, dtype=torch.bfloat16)
    h0 = 0.1 * torch.randn(2, 2, 128, 128)
    with torch.no_grad():
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                          output_final_state=True, kernel="torch_npu")  # fmt: skip
        want_o, want_f = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True, kernel="reference")  # fmt: skip
    ((name, shapes, kw),) = rec.calls
    assert name == "npu_chunk_gated_delta_rule" and shapes == ((80, 1, 128),) * 2 + ((80, 2, 128),)
    assert kw["initial_state"].shape == (2, 2, 128, 128) and kw["initial_state"].dtype == q.dtype
    torch.testing.assert_close(kw["initial_state"].float(), h0.transpose(-1, -2).bfloat16().float())
    assert kw["actual_seq_lengths"].tolist() == [40, 40]
    assert kw["actual_seq_lengths"].dtype == torch.int32
    assert kw["g"].dtype == torch.float32 and kw["g"].shape == (80, 2)
    assert kw["beta"].shape == (80, 2) and kw["scale"] == 128**-0.5
    assert o.shape == v.shape and final.dtype == torch.float32 and final.shape == h0.shape
    torch.testing.assert_close(o.float(), want_o.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(final, want_f, rtol=2e-2, atol=2e-2)


def test_torch_npu_packed_passes_the_segment_lengths(monkeypatch):
    rec = install_torch_npu(monkeypatch)
    q, k, v, g, beta = _problem(t=50, dk=128, dv=128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 7, 50], dtype=torch.int32)
    with torch.no_grad():
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, kernel="torch_npu")
        want, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, kernel="reference")
    assert rec.calls[0][2]["actual_seq_lengths"].tolist() == [7, 43]
    assert rec.calls[0][2]["initial_state"].shape == (2, 2, 128, 128)
    torch.testing.assert_close(o.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_torch_npu_refuses_a_call_that_needs_gradients(monkeypatch):
    install_torch_npu(monkeypatch)
    q, k, v, g, beta = _problem(dk=128, dv=128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'torch_npu' cannot run this call: it is forward only"):
        chunk_gated_delta_rule(q.requires_grad_(), k, v, g, beta, kernel="torch_npu")


def test_fla_receives_fla_keywords_unchanged(monkeypatch):
    rec = install_fla(monkeypatch)
    q, k, v, g, beta = _problem(t=20)
    cu = torch.tensor([0, 5, 20])
    chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, cu_seqlens=cu, output_final_state=True,
                           use_qk_l2norm_in_kernel=True, kernel="fla")  # fmt: skip
    ((name, _, kw),) = rec.calls
    assert name == "chunk_gated_delta_rule" and kw["cu_seqlens"] is cu
    assert (kw["scale"], kw["output_final_state"], kw["use_qk_l2norm_in_kernel"]) == (
        0.3,
        True,
        True,
    )
    assert kw["initial_state"] is None


FORWARD_CHAIN = ["npu_chunk_local_cumsum", "npu_chunk_scaled_dot_kkt", "npu_solve_tri",
                 "npu_recompute_w_u_fwd", "npu_chunk_gated_delta_rule_fwd_h", "npu_chunk_fwd_o"]  # fmt: skip
BACKWARD_CHAIN = ["npu_recompute_w_u_fwd", "npu_chunk_gated_delta_rule_fwd_h",
                  "npu_chunk_bwd_dv_local", "npu_chunk_gated_delta_rule_bwd_dhu",
                  "npu_chunk_bwd_dqkwg", "npu_prepare_wy_repr_bwd_da",
                  "npu_prepare_wy_repr_bwd_full", "npu_chunk_local_cumsum"]  # fmt: skip


def test_fla_npu_chain_calls_the_documented_blocks_in_order_with_head_first_layouts(monkeypatch):
    """The stand-in's forward blocks compute fla_npu's documented results, so the output must
    equal the reference; its backward blocks answer zeros (only the calls are checked)."""
    rec = install_fla_npu(monkeypatch)
    q, k, v, g, beta = _problem(t=128, h=1, hv=2, dk=128, dv=128, dtype=torch.bfloat16)
    h0 = 0.1 * torch.randn(1, 2, 128, 128)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
    o, final = chunk_gated_delta_rule(*leaves, initial_state=h0, kernel="fla_npu")
    assert rec.names() == FORWARD_CHAIN and final is None
    want, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, kernel="reference")
    torch.testing.assert_close(o.float(), want.float(), rtol=3e-2, atol=3e-2)
    shapes = dict((name, s) for name, s, _ in rec.calls)
    assert shapes["npu_chunk_fwd_o"][0] == (1, 2, 128, 128)  # q repeated to HV, head first
    assert shapes["npu_chunk_local_cumsum"] == ((1, 2, 128), 64)
    assert rec.calls[0][2]["head_first"] is True
    assert rec.calls[2][2]["layout"] == "bsnd" and shapes["npu_solve_tri"][0] == (1, 128, 2, 64)
    rec.calls.clear()
    grads = torch.autograd.grad(o.float().sum(), leaves)
    assert rec.names() == BACKWARD_CHAIN and rec.calls[-1][2]["reverse"] is True
    assert [tuple(x.shape) for x in grads] == [tuple(x.shape) for x in leaves]
    assert [x.dtype for x in grads] == [x.dtype for x in leaves]


def test_fla_npu_chain_packed_passes_segments_and_chunk_indices(monkeypatch):
    rec = install_fla_npu(monkeypatch)
    q, k, v, g, beta = _problem(t=192, dk=128, dv=128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 64, 192])  # the stand-in's packed numbers need chunk-aligned segments
    h0 = 0.1 * torch.randn(2, 2, 128, 128)
    with torch.no_grad():
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0,
                                      kernel="fla_npu")  # fmt: skip
        want, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0,
                                         kernel="reference")  # fmt: skip
    kw = rec.calls[1][2]
    assert kw["cu_seqlens"] == [0, 64, 192] and kw["chunk_indices"] == [0, 0, 1, 0, 1, 1]
    assert rec.calls[2][2]["layout"] == "tnd"
    torch.testing.assert_close(o.float(), want.float(), rtol=3e-2, atol=3e-2)
    assert fla_npu_chain.chunk_indices([0, 30, 100]) == [0, 0, 1, 0, 1, 1]


def test_fla_npu_refuses_what_its_kernels_cannot_do(monkeypatch):
    install_fla_npu(monkeypatch)
    q, k, v, g, beta = _problem(dk=128, dv=128, dtype=torch.bfloat16)
    h0 = torch.zeros(1, 2, 128, 128, requires_grad=True)
    with pytest.raises(ValueError, match="no initial-state gradient"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, kernel="fla_npu")
    with pytest.raises(ValueError, match="float16/bfloat16"):
        chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, kernel="fla_npu")


# ------------------------------------------------------------------ doctor


def test_doctor_says_which_gated_delta_kernel_runs(monkeypatch):
    from mcore_npu.tools import doctor

    here = doctor.check_operator("chunk_gated_delta_rule", doctor._probe_torch())
    assert here.status == doctor.OK and here.detail == (
        "auto -> reference on cpu (no usable torch_npu)"
    )
    npu = doctor._Probe(torch=torch, accelerator="npu")
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setitem(sys.modules, "fla_npu", None)
    install_torch_npu(monkeypatch)
    bare = doctor.check_operator("chunk_gated_delta_rule", npu)
    assert (
        bare.status == doctor.WARN
        and "training -> reference (torch_npu: it is forward only" in (bare.detail)
    )
    assert "forward-only -> torch_npu" in bare.detail
    install_fla(monkeypatch)
    assert "training -> fla (" in doctor.check_operator("chunk_gated_delta_rule", npu).detail
    install_fla_npu(monkeypatch)
    check = doctor.check_operator("chunk_gated_delta_rule", npu)
    assert check.status == doctor.OK and check.detail.startswith(
        "auto on NPU tensors training -> fla_npu (torch_npu: it is forward only"
    )
