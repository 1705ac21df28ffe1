"""``NPUMambaMixer``: Megatron's ``MambaMixer`` names, shapes and checkpoint splits; its numbers
against float64 oracles written from the definitions; packed (thd) sequences; no CUDA package.

Megatron's own ``MambaMixer`` cannot be built here (its module imports Triton, its constructor
raises without mamba_ssm), so the names are checked against the list its source defines
(megatron-core 0.16.1 ``ssm/mamba_mixer.py``: ``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``,
``D``, ``norm``, ``out_proj``; ``in_proj.weight`` saved as z, x, B, C, dt and ``conv1d.*`` as x,
B, C). The oracle runs the conv as explicit sums (``gdn_cases.conv_oracle``) and the scan token
by token (``mamba_cases.scan_oracle``), sharing no code with the layer.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.packed_seq_params import PackedSeqParams

from mcore_npu.tools.gdn_cases import conv_oracle
from mcore_npu.tools.mamba_cases import norm_oracle, scan_oracle
from tests.transformer.mamba_models import mamba_config, mamba_mixer

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

MEGATRON_NAMES = ["in_proj.layer_norm_weight", "in_proj.weight", "conv1d.weight", "conv1d.bias",
                  "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"]  # fmt: skip


def test_parameter_names_and_shapes_are_megatrons():
    config = mamba_config()
    mixer = mamba_mixer(config)
    h, p, g, n = 4, 8, 2, 8
    d_inner, conv_dim = h * p, h * p + 2 * g * n
    shapes = {name: list(t.shape) for name, t in mixer.state_dict().items() if "extra" not in name}
    assert sorted(shapes) == sorted(MEGATRON_NAMES)
    assert shapes["in_proj.weight"] == [2 * d_inner + 2 * g * n + h, config.hidden_size]
    assert shapes["conv1d.weight"] == [conv_dim, 1, 4] and shapes["conv1d.bias"] == [conv_dim]
    assert shapes["dt_bias"] == shapes["A_log"] == shapes["D"] == [h]
    assert shapes["norm.weight"] == [d_inner]
    assert mixer.A_log.dtype == mixer.D.dtype == torch.float32
    assert all(getattr(getattr(mixer, n), "tensor_model_parallel", False)
               for n in ("dt_bias", "A_log", "D"))  # fmt: skip


def test_checkpoint_keys_split_as_megatron_saves_them():
    mixer = mamba_mixer(mamba_config())
    sharded = mixer.sharded_state_dict(prefix="mixer.")
    apply_factories(sharded)  # in place, as dist_checkpointing does before writing
    keys = sorted(t.key for t in _flat(sharded))
    assert [k for k in keys if k.startswith("mixer.in_proj.weight")] == [
        f"mixer.in_proj.weight.{part}" for part in sorted(["z", "x", "B", "C", "dt"])
    ]
    for name in ("weight", "bias"):
        assert [k for k in keys if k.startswith(f"mixer.conv1d.{name}")] == [
            f"mixer.conv1d.{name}.{part}" for part in sorted(["x", "B", "C"])
        ]
    assert {"mixer.A_log", "mixer.D", "mixer.dt_bias", "mixer.norm.weight"} <= set(keys)


def _flat(tree):
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _flat(value)]
    if isinstance(tree, list):
        return [leaf for value in tree for leaf in _flat(value)]
    return [tree] if isinstance(tree, ShardedTensor) else []


def _oracle(mixer, hidden, segments=None):
    """The mixer in float64 from its parameters: [s, b, h] -> [s, b, h]."""
    w = {k: v.detach().double() for k, v in mixer.state_dict().items() if "extra" not in k}
    x = hidden.double()
    rms = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + mixer.config.layernorm_epsilon)
    zxbcdt = (rms * w["in_proj.layer_norm_weight"]) @ w["in_proj.weight"].t()  # [s, b, C]
    h, p, g, n = 4, 8, 2, 8
    z, xbc, dt = zxbcdt.transpose(0, 1).split([h * p, h * p + 2 * g * n, h], dim=-1)
    b, s = xbc.shape[:2]
    bounds = None if segments is None else [0, *torch.tensor(segments).cumsum(0).tolist()]
    xbc = conv_oracle(xbc, w["conv1d.weight"], bounds, w["conv1d.bias"])
    xs, B, C = xbc.split([h * p, g * n, g * n], dim=-1)
    seq_idx = None
    if segments is not None:
        seq_idx = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(segments))[None]
    y, _ = scan_oracle(xs.reshape(b, s, h, p), dt, -w["A_log"].exp(), B.reshape(b, s, g, n),
                       C.reshape(b, s, g, n), D=w["D"], dt_bias=w["dt_bias"], seq_idx=seq_idx,
                       softplus=True)  # fmt: skip
    y = norm_oracle(y.reshape(b, s, h * p), w["norm.weight"], z, eps=1e-5, group_size=h * p // g,
                    norm_before_gate=False)  # fmt: skip
    return (y @ w["out_proj.weight"].t()).transpose(0, 1)


def test_forward_matches_the_float64_oracle_and_every_parameter_learns():
    mixer = mamba_mixer(mamba_config())
    hidden = torch.randn(13, 2, 32, generator=torch.Generator().manual_seed(3))
    out, bias = mixer(hidden)
    assert bias is None and out.shape == hidden.shape
    torch.testing.assert_close(out.double(), _oracle(mixer, hidden), atol=1e-5, rtol=1e-4)
    out.square().sum().backward()
    for name, param in mixer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_packed_sequences_give_each_sequence_its_own_output():
    mixer = mamba_mixer(mamba_config())
    lengths = [5, 1, 9, 7]
    seqs = [torch.randn(n, 1, 32, generator=torch.Generator().manual_seed(10 + n)) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=9, max_seqlen_kv=9)  # fmt: skip
    out, _ = mixer(torch.cat(seqs), packed_seq_params=packed)
    alone = torch.cat([mixer(s)[0] for s in seqs])
    torch.testing.assert_close(out, alone, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        out.double(), _oracle(mixer, torch.cat(seqs), lengths), atol=1e-5, rtol=1e-4
    )


def test_selective_recompute_gives_the_same_gradients():
    hidden = torch.randn(9, 2, 32, generator=torch.Generator().manual_seed(5))
    grads = []
    for recompute in (None, "selective"):
        config = mamba_config(recompute_granularity=recompute)
        mixer = mamba_mixer(config)
        assert mixer.recompute_core == (recompute == "selective")
        mixer(hidden)[0].square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in mixer.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(bias=True), "bias: True"),
        (dict(norm_before_gate=True), "norm_before_gate: True"),
        (dict(A_init_range=(0, 4)), "A_init_range"),
    ],
)
def test_what_megatron_refuses_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mamba_mixer(mamba_config(), **kwargs)


def test_sizes_that_do_not_divide_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="mamba_num_groups: 3 does not divide the 4"):
        mamba_mixer(mamba_config(mamba_num_groups=3))


def test_inference_is_refused():
    mixer = mamba_mixer(mamba_config())
    with pytest.raises(NotImplementedError, match="inference_context"):
        mixer(torch.zeros(4, 1, 32), inference_context=object())


def test_no_cuda_package_is_imported_even_where_installed(tmp_path):
    """mamba_ssm, causal_conv1d, triton and transformer_engine as modules that raise on import
    (after Megatron's own import, which on 0.19 loads triton itself): building and running the
    mixer never reaches them, nor Megatron's ``mamba_mixer``."""
    code = f"""
import sys
import megatron.core  # what Megatron imports itself (0.19: triton) is not the layer's doing
before = set(sys.modules)
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mamba_ssm", "causal_conv1d", "triton", "transformer_engine"):
            raise ModuleNotFoundError("blocked: " + name)
sys.meta_path.insert(0, Blocker())
sys.path.insert(0, {str(__import__("pathlib").Path(__file__).resolve().parents[2])!r})
import pytest, torch
from mcore_npu.training import runtime
runtime.initialize(runtime.ParallelLayout(), seed=0)
from tests.transformer.mamba_models import mamba_config, mamba_mixer
mixer = mamba_mixer(mamba_config())
mixer(torch.randn(6, 1, 32))[0].sum().backward()
assert "megatron.core.ssm.mamba_mixer" not in sys.modules
blocked = ("mamba_ssm", "causal_conv1d", "triton", "transformer_engine")
assert not [m for m in set(sys.modules) - before if m.split(".")[0] in blocked]
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_conv_runs_silu_after_the_bias():
    """The conv's bias enters before SiLU (Megatron's ``act(conv1d(x))`` with ``conv1d.bias``):
    a zero input gives ``silu(bias)`` in x, B, C."""
    mixer = mamba_mixer(mamba_config())
    xbc = torch.zeros(1, 3, mixer.conv_dim_local_tp)
    from mcore_npu.ops.gated_delta import causal_conv1d

    got = causal_conv1d(xbc, mixer.conv1d.weight, mixer.conv1d.bias)
    torch.testing.assert_close(got[0, 0], F.silu(mixer.conv1d.bias))
