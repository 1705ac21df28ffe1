"""Mamba2's operators (``mcore_npu.ops.mamba_chunk_scan_combined``, ``rms_norm_gated``, the conv
with bias) against float64 oracles written from the definitions (``mcore_npu.tools.mamba_cases``,
``gdn_cases.conv_oracle``), and their call contracts.

No NPU here: ``mamba_ssm``'s scan and torch_npu's ``npu_masked_causal_conv1d`` are stand-in
modules in ``sys.modules`` that record their calls and answer from their documented contracts.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mcore_npu import ops
from mcore_npu.ops import registry
from mcore_npu.ops.mamba import ssd_reference
from mcore_npu.tools.gdn_cases import conv_oracle
from mcore_npu.tools.mamba_cases import (
    check_reference_mamba_case,
    load_mamba_cases,
    scan_oracle,
)

CASES = load_mamba_cases()
NPU = types.SimpleNamespace(type="npu", index=0)


def _inputs(b=2, t=33, h=4, p=3, g=2, n=5, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen)

    named = dict(
        x=draw(b, t, h, p),
        dt=draw(b, t, h),
        A=-(0.2 + draw(h).abs()),
        B=draw(b, t, g, n),
        C=draw(b, t, g, n),
        D=draw(h),
        z=draw(b, t, h, p),
        dt_bias=0.5 * draw(h),
        initial_states=draw(b, h, p, n),
    )
    return {k: v.requires_grad_(grad) for k, v in named.items()}


def _scan(named, chunk, **kwargs):
    args = [named[k] for k in ("x", "dt", "A", "B", "C")]
    rest = {k: v for k, v in named.items() if k not in ("x", "dt", "A", "B", "C")}
    return ops.mamba_chunk_scan_combined(
        *args, chunk, **rest, dt_softplus=True, return_final_states=True, **kwargs
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_table_matches_the_float64_oracle(case):
    """fp32: within 1e-4 of max|want| for y, the final states and every gradient."""
    result = check_reference_mamba_case(case)
    assert result.passed, result
    names = [c.name for c in result.comparisons]
    scan = case.operator == "mamba_chunk_scan_combined"
    assert names[:2] == (["forward", "state"] if scan else ["forward", "grad0"])


def test_the_table_covers_what_the_issue_names():
    scan = [dict(c.params) for c in CASES if c.operator == "mamba_chunk_scan_combined"]
    assert {p["tokens"] for p in scan} >= {1, 15, 16, 17, 70}
    assert {p["chunk"] for p in scan} == {8, 16}
    assert any(p["groups"][0] < p["heads"][0] for p in scan)  # g < h
    assert {p.get("D") for p in scan} >= {"head", "headdim"}
    assert any(p["softplus"] and p.get("dt_limit") for p in scan)
    assert any(p["decay"] >= 1e4 for p in scan) and any(p.get("segments") for p in scan)
    norms = [dict(c.params) for c in CASES if c.operator == "rms_norm_gated"]
    assert {p["norm_before_gate"] for p in norms} == {True, False}


def test_seq_idx_segments_equal_each_segment_alone():
    """Packed by ``seq_idx``: each segment's output is that segment run alone (the first
    segment from ``initial_states``, the others from zero), to fp32 rounding."""
    named = _inputs(b=1, t=29)
    lengths = [6, 1, 13, 9]
    seq_idx = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))[None].int()
    packed, final = _scan(named, 8, seq_idx=seq_idx)
    start = 0
    for i, length in enumerate(lengths):
        alone = {
            k: v[:, start : start + length] if v.dim() >= 3 and k != "initial_states" else v
            for k, v in named.items()
        }
        if i:
            alone["initial_states"] = torch.zeros_like(named["initial_states"])
        y, last = _scan(alone, 8)
        torch.testing.assert_close(packed[:, start : start + length], y, atol=1e-5, rtol=1e-5)
        start += length
    torch.testing.assert_close(final, last, atol=1e-5, rtol=1e-5)


def test_the_result_does_not_change_with_the_chunk_size():
    named = _inputs(t=70)
    seq_idx = torch.repeat_interleave(torch.arange(3), torch.tensor([20, 41, 9]))
    seq_idx = seq_idx[None].expand(2, -1).int()
    y8, f8 = _scan(named, 8, seq_idx=seq_idx)
    for chunk in (1, 16, 64, 128):
        y, f = _scan(named, chunk, seq_idx=seq_idx)
        torch.testing.assert_close(y, y8, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(f, f8, atol=2e-6, rtol=2e-6)


def test_very_negative_a_gives_finite_outputs_and_gradients():
    """Decays of exp(-1e30) in a step: the exponents are sums of non-positive terms, never
    differences, so nothing overflows; the state forgets everything at each token."""
    named = _inputs(t=20, grad=True)
    with torch.no_grad():
        named["A"].copy_(torch.tensor([-1e30, -1e4, -50.0, -1.0]))
    y, final = _scan(named, 8)
    (y.sum() + final.sum()).backward()
    assert torch.isfinite(y).all() and torch.isfinite(final).all()
    assert all(torch.isfinite(v.grad).all() for v in named.values())
    exact, _ = scan_oracle(
        *(named[k].detach().double() for k in ("x", "dt", "A", "B", "C")),
        D=named["D"].detach().double(),
        z=named["z"].detach().double(),
        dt_bias=named["dt_bias"].detach().double(),
        initial_states=named["initial_states"].detach().double(),
        softplus=True,
    )
    torch.testing.assert_close(y.detach().double(), exact, atol=1e-5, rtol=1e-4)


def test_the_backward_is_not_a_loop_over_tokens():
    """The autograd graph has as many nodes at T = 512 as at T = 64 (chunks are batched; the
    within-chunk part is one autograd function)."""

    def nodes(t):
        y = _scan(_inputs(b=1, t=t, grad=True), 32)[0]
        seen, todo = set(), [y.grad_fn]
        while todo:
            fn = todo.pop()
            if fn is not None and fn not in seen:
                seen.add(fn)
                todo += [next_fn for next_fn, _ in fn.next_functions]
        return len(seen)

    assert nodes(512) == nodes(64)


@pytest.mark.parametrize(
    ("change", "argument", "fix"),
    [
        (dict(x=torch.zeros(2, 3, 4)), "x", "batch, tokens, heads, headdim"),
        (dict(dt=torch.zeros(2, 33, 3)), "dt", "batch, tokens, heads"),
        (dict(A=torch.ones(4)), "A", "A <= 0"),
        (dict(B=torch.zeros(2, 33, 3, 5), C=torch.zeros(2, 33, 3, 5)), "B", "divides the heads"),
        (dict(C=torch.zeros(2, 33, 2, 4)), "C", "B's shape"),
        (dict(D=torch.zeros(3)), "D", r"\[heads\] or \[heads, headdim\]"),
        (dict(z=torch.zeros(2, 33, 4, 2)), "z", "x's shape"),
        (dict(dt_bias=torch.zeros(4, 1)), "dt_bias", r"\[heads\]"),
        (dict(initial_states=torch.zeros(2, 4, 3, 4)), "initial_states", "dstate"),
    ],
)
def test_bad_arguments_name_the_argument_and_the_fix(change, argument, fix):
    named = {**_inputs(), **change}
    with pytest.raises(ValueError, match=rf"mamba_chunk_scan_combined: {argument}\b(.|\n)*{fix}"):
        _scan(named, 8)


@pytest.mark.parametrize(
    ("kwargs", "argument", "error"),
    [
        (dict(seq_idx=torch.zeros(2, 33)), "seq_idx", TypeError),
        (dict(seq_idx=torch.zeros(2, 32, dtype=torch.int32)), "seq_idx", ValueError),
        (dict(seq_idx=torch.arange(33, 0, -1)[None].expand(2, -1).int()), "seq_idx", ValueError),
        (dict(dt_limit=(1.0, 0.5)), "dt_limit", ValueError),
        (dict(chunk=0), "chunk_size", ValueError),
    ],
)
def test_bad_options_name_the_argument(kwargs, argument, error):
    chunk = kwargs.pop("chunk", 8)
    with pytest.raises(error, match=rf"mamba_chunk_scan_combined: {argument}\b"):
        _scan(_inputs(), chunk, **kwargs)


def _install(monkeypatch, module_name: str, **functions):
    for i in range(1, module_name.count(".") + 2):
        name = ".".join(module_name.split(".")[:i])
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    for name, fn in functions.items():
        setattr(sys.modules[module_name], name, fn)


def test_mamba_ssm_is_called_in_its_own_convention(monkeypatch):
    """A kernel named ``mamba_ssm`` gets the call unchanged: the six positional arguments and
    mamba_ssm's keywords (stand-in: records, answers with the reference)."""
    calls = []

    def stand_in(x, dt, A, B, C, chunk_size, **kwargs):
        calls.append((x, chunk_size, kwargs))
        return ssd_reference(x, dt, A, B, C, chunk_size, **kwargs)

    _install(monkeypatch, "mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=stand_in)
    named = _inputs()
    got = _scan(named, 16, kernel="mamba_ssm")
    want = _scan(named, 16, kernel="reference")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    ((x, chunk, kwargs),) = calls
    assert x is named["x"] and chunk == 16
    assert set(kwargs) == {
        "D",
        "z",
        "dt_bias",
        "initial_states",
        "seq_idx",
        "dt_softplus",
        "dt_limit",
        "return_final_states",
    }
    assert kwargs["dt_limit"] == (0.0, float("inf")) and kwargs["return_final_states"] is True
    assert registry.resolve("mamba_chunk_scan_combined", "auto", NPU).kernel == "mamba_ssm"


def test_without_mamba_ssm_an_npu_call_runs_the_reference_with_one_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)
    monkeypatch.setattr(registry, "warn_once", lambda key, message: calls.append(message))
    calls = []
    assert registry.resolve("mamba_chunk_scan_combined", "auto", NPU).kernel == "reference"
    assert "mamba_ssm" in calls[0] and "pip install a triton-ascend build" not in calls[0]
    with pytest.raises(ImportError, match="triton-ascend build of mamba-ssm"):
        _scan(_inputs(), 8, kernel="mamba_ssm")


def test_rms_norm_gated_refuses_bad_arguments():
    x, z, w = torch.zeros(2, 12), torch.zeros(2, 12), torch.ones(12)
    with pytest.raises(ValueError, match="rms_norm_gated: group_size"):
        ops.rms_norm_gated(x, w, z, group_size=5)
    with pytest.raises(ValueError, match="rms_norm_gated: weight"):
        ops.rms_norm_gated(x, torch.ones(6), z)
    with pytest.raises(ValueError, match="rms_norm_gated: z"):
        ops.rms_norm_gated(x, w, torch.zeros(2, 6))


def test_the_conv_takes_a_bias_and_packed_segments():
    gen = torch.Generator().manual_seed(3)
    x, w, bias = (
        torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((1, 12, 6), (6, 1, 4), (6,))
    )
    bounds = [0, 5, 6, 12]
    got = ops.causal_conv1d(x, w, bias, cu_seqlens=torch.tensor(bounds, dtype=torch.int32))
    torch.testing.assert_close(got, conv_oracle(x, w, bounds, bias))
    with pytest.raises(ValueError, match="causal_conv1d: bias"):
        ops.causal_conv1d(x, w, torch.zeros(5, dtype=torch.float64))


def test_the_950_conv_is_called_in_its_layout_without_gradients(monkeypatch):
    """torch_npu's ``npu_masked_causal_conv1d`` (stand-in: its documented sum, x ``[S, B, H]``,
    weight ``[W, H]``, no bias or activation) where asked for; refused under gradients."""
    seen = []

    def stand_in(x, weight, *, mask=None):
        seen.append((tuple(x.shape), tuple(weight.shape)))
        padded = torch.nn.functional.pad(x, (0, 0, 0, 0, 2, 0))
        return sum(weight[k] * padded[k : k + x.shape[0]] for k in range(3))

    _install(monkeypatch, "torch_npu", npu_masked_causal_conv1d=stand_in)
    sys.modules["torch_npu"].npu = types.SimpleNamespace(get_soc_version=lambda: 260)
    gen = torch.Generator().manual_seed(4)
    x, w, bias = (torch.randn(*s, generator=gen) for s in ((2, 9, 8), (8, 1, 3), (8,)))
    with torch.no_grad():
        got = ops.causal_conv1d(x.bfloat16(), w.bfloat16(), bias.bfloat16(), kernel="torch_npu")
    want = conv_oracle(*(t.bfloat16().double() for t in (x, w)), None, bias.bfloat16().double())
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)
    assert seen == [((9, 2, 8), (3, 8))]
    with pytest.raises(ValueError, match="needs gradients"):
        ops.causal_conv1d(x.bfloat16().requires_grad_(), w.bfloat16(), kernel="torch_npu")
