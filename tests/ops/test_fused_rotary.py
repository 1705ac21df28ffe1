"""``npu_rotary_mul``: the reference against Megatron's unfused RoPE and a float64 oracle, its
refusals (each naming the argument), and the kernel switch with a stand-in torch_npu (no NPU
here; ``tests/fused_standin.py`` records the calls and answers with the reference)."""

from __future__ import annotations

import pytest
import torch

from mcore_npu import ops
from mcore_npu.ops.fused_rotary import rotary_mul_takes_mode
from mcore_npu.ops.reference import npu_rotary_mul
from tests.fused_standin import install


def _angles(s, d, interleaved, seed=0):
    """Megatron's emb: ``cat(f, f)`` or pairwise duplicated, ``[s, 1, 1, d]``."""
    freqs = torch.rand(s, d // 2, generator=torch.Generator().manual_seed(seed)) * 6
    if interleaved:
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_megatrons_unfused_rope(interleaved, dtype):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    x = torch.randn(6, 2, 3, 16).to(dtype)
    emb = _angles(6, 16, interleaved)
    want = _apply_rotary_pos_emb_bshd(x, emb, rotary_interleaved=interleaved)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = npu_rotary_mul(x, cos, sin, "interleave" if interleaved else "half")
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_reference_gradients_pass_gradcheck(mode):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    r1 = torch.randn(3, 1, 1, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    r2 = torch.randn(3, 1, 1, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: npu_rotary_mul(*a, rotary_mode=mode), (x, r1, r2))


def test_a_pure_rotation_keeps_each_pairs_norm():
    x = torch.randn(5, 1, 2, 8)
    emb = _angles(5, 8, False)
    y = npu_rotary_mul(x, emb.cos(), emb.sin())
    pair_norm = lambda t: t[..., :4] ** 2 + t[..., 4:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(y), pair_norm(x))
    assert not torch.allclose(y, x)


def _ok():
    return torch.randn(4, 2, 3, 8), torch.ones(4, 1, 1, 8), torch.zeros(4, 1, 1, 8)


REFUSALS = [
    ("rank", lambda x, c, s: (x[0], c[0], s[0]), {}, ValueError, "input: rank 3"),
    ("dtype", lambda x, c, s: (x.int(), c, s), {}, TypeError, "input: dtype torch.int32"),
    ("r1 dtype", lambda x, c, s: (x, c.half(), s), {}, TypeError, "r1: dtype torch.float16"),
    ("r2 shape", lambda x, c, s: (x, c, torch.zeros(3, 1, 1, 8)), {}, ValueError,
     "r2: shape [3, 1, 1, 8] does not broadcast"),
    ("odd D", lambda x, c, s: (x[..., :7], c[..., :7], s[..., :7]), {}, ValueError,
     "D = 7 must be even"),
    ("D 896", lambda x, c, s: (torch.zeros(1, 1, 1, 896),) * 3, {}, ValueError, "< 896"),
    ("B 1000", lambda x, c, s: (torch.zeros(1, 1000, 1, 8), c[:1], s[:1]), {}, ValueError,
     "each must be < 1000"),
    ("interleave B*N", lambda x, c, s: (torch.zeros(1, 40, 25, 8), c[:1], s[:1]),
     {"rotary_mode": "interleave"}, ValueError, "40 * 25 = 1000"),
    ("mode", lambda x, c, s: (x, c, s), {"rotary_mode": "quarter"}, ValueError,
     "rotary_mode: unknown mode 'quarter'"),
    ("not a tensor", lambda x, c, s: (x, 1.0, s), {}, TypeError, "r1: expected a torch.Tensor"),
]  # fmt: skip


@pytest.mark.parametrize("build,kwargs,exc,text", [r[1:] for r in REFUSALS],
                         ids=[r[0] for r in REFUSALS])  # fmt: skip
@pytest.mark.parametrize("entry", ["reference", "dispatch"])
def test_refusals_name_the_argument_and_the_fix(build, kwargs, exc, text, entry, monkeypatch):
    standin = install(monkeypatch)
    args = build(*_ok())
    with pytest.raises(exc) as info:
        if entry == "reference":
            npu_rotary_mul(*args, **kwargs)
        else:
            ops.rotary_mul(*args, **kwargs, kernel="torch_npu")
    assert info.value.args[0].startswith("npu_rotary_mul: ") and text in str(info.value)
    assert "fix: " in str(info.value)
    assert standin.calls == []  # refused before the kernel


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_dispatch_passes_exactly_input_r1_r2_and_the_mode(mode, monkeypatch):
    standin = install(monkeypatch)
    x, c, s = _ok()
    y = ops.rotary_mul(x, c, s, mode, kernel="torch_npu")
    ((name, args, kwargs),) = standin.calls
    assert name == "npu_rotary_mul" and all(a is b for a, b in zip(args, (x, c, s)))
    assert kwargs == {"rotary_mode": mode}
    torch.testing.assert_close(y, npu_rotary_mul(x, c, s, mode), rtol=0, atol=0)


def test_auto_runs_the_reference_on_cpu(monkeypatch):
    standin = install(monkeypatch)
    x, c, s = _ok()
    torch.testing.assert_close(ops.rotary_mul(x, c, s), npu_rotary_mul(x, c, s))
    assert standin.calls == []


def test_an_old_torch_npu_without_rotary_mode_gets_three_arguments_and_d_128(monkeypatch):
    standin = install(monkeypatch, old_rotary=True)
    assert not rotary_mul_takes_mode(standin.npu_rotary_mul)
    x = torch.randn(2, 1, 2, 128)
    c, s = torch.ones(2, 1, 1, 128), torch.zeros(2, 1, 1, 128)
    ops.rotary_mul(x, c, s, kernel="torch_npu")
    ((_, args, kwargs),) = standin.calls
    assert len(args) == 3 and kwargs == {}
    with pytest.raises(ValueError, match="rotary_mode 'interleave' needs an npu_rotary_mul that"):
        ops.rotary_mul(x, c, s, "interleave", kernel="torch_npu")
    x64, c64, s64 = x[..., :64], c[..., :64], s[..., :64]
    with pytest.raises(ValueError, match="needs D = 128, got D = 64"):
        ops.rotary_mul(x64, c64, s64, kernel="torch_npu")
    assert len(standin.calls) == 1


def test_the_probe_reads_the_signature_not_a_version():
    def newer(input, r1, r2, rotary_mode="half"):
        return input

    def older(input, r1, r2):
        return input

    assert rotary_mul_takes_mode(newer) and not rotary_mul_takes_mode(older)
    assert rotary_mul_takes_mode(torch.add)  # a builtin: taken to be a newer release


@pytest.mark.parametrize("old", [False, True])
def test_verify_kernel_mode_calls_the_installed_operator(monkeypatch, old):
    from mcore_npu.tools.fused_cases import check_kernel_fused_case, load_fused_cases

    standin = install(monkeypatch, old_rotary=old)
    case = next(c for c in load_fused_cases() if c.id == "npu_rotary_mul/half_head_dim_128/float32")
    assert check_kernel_fused_case(case, "cpu").passed
    ((name, args, kwargs),) = standin.calls
    assert name == "npu_rotary_mul" and len(args) == 3
    assert kwargs == ({} if old else {"rotary_mode": "half"})
