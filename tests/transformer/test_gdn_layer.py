"""``NPUGatedDeltaNet`` against Megatron-Core's own ``GatedDeltaNet`` (names, shapes, checkpoint
splits, numbers), and the layer's packed (thd) path against each sequence alone.

Megatron's class cannot be built here as shipped: its constructor raises ImportError without
``fla`` (Triton, CUDA-only). The twin tests build it anyway with stand-ins for fla, set with
pytest's ``monkeypatch`` on Megatron's module(s) for the test only: ``HAVE_FLA = True``, fla's
``l2norm`` (``x * rsqrt(sum(x^2) + 1e-6)``, ``mcore_npu.ops.gated_delta.l2norm``) and, where
megatron-core 0.19 picks the kernel at build time, a ``chunk_gated_delta_rule`` that fails if
called. With ``deterministic_mode=True`` Megatron's forward then runs its own pure-torch
``torch_chunk_gated_delta_rule`` and ``nn.Conv1d`` (no fla kernel is ever called). Its submodules get the NPU spec's ``NormColumnParallelLinear`` (the TE name layout), a torch RMSNorm
with TE's ``_extra_state`` entry (what ``TENorm`` saves) and ``RowParallelLinear``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from megatron.core.packed_seq_params import PackedSeqParams

from tests.megatron_features import GDN_CONFIG_FIELDS, needs_fields
from tests.transformer.gdn_models import gdn_config, gdn_layer

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime"),
              needs_fields(*GDN_CONFIG_FIELDS, feature="Gated DeltaNet")]  # fmt: skip


def _defining_modules(package):
    """``package`` and the Megatron modules that define ``GatedDeltaNet`` and its bases."""
    modules = {package.__name__: package}
    for cls in package.GatedDeltaNet.__mro__:
        if cls.__module__.startswith("megatron.core.ssm"):
            modules[cls.__module__] = sys.modules[cls.__module__]
    return list(modules.values())


def _no_fla_kernel(*args, **kwargs):
    """fla's ``chunk_gated_delta_rule`` stand-in: the tests never call it (they run Megatron's
    forward with ``deterministic_mode=True``, its torch path)."""
    raise AssertionError("fla's chunk_gated_delta_rule was called; the test wants the torch path")


@pytest.fixture
def megatron_gdn(monkeypatch):
    """Megatron's ``GatedDeltaNet`` (stand-ins for fla, see the module docstring)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import gated_delta_net as megatron_gdn_module
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mcore_npu.ops.gated_delta import l2norm
    from mcore_npu.transformer.norm_linear import NormColumnParallelLinear
    from mcore_npu.transformer.norms import SequenceParallelNorm

    # on the module(s) that read them: the package itself (<= 0.18) or, where it became a
    # package of modules (0.19), those defining GatedDeltaNet and its base (``gdn``, ``common``)
    for module in _defining_modules(megatron_gdn_module):
        if hasattr(module, "HAVE_FLA"):
            monkeypatch.setattr(module, "HAVE_FLA", True)
            monkeypatch.setattr(module, "l2norm", l2norm, raising=False)
        if getattr(module, "chunk_gated_delta_rule", 0) is None:  # 0.19 picks it at build
            monkeypatch.setattr(module, "chunk_gated_delta_rule", _no_fla_kernel)

    def build(config, seed=0):
        submodules = megatron_gdn_module.GatedDeltaNetSubmodules(
            in_proj=NormColumnParallelLinear,
            out_norm=ModuleSpec(module=SequenceParallelNorm, params={"extra_state": True}),
            out_proj=RowParallelLinear,
        )
        torch.manual_seed(seed)
        groups = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        return megatron_gdn_module.GatedDeltaNet(
            config, submodules, layer_number=1, pg_collection=groups
        )

    return build


def _shapes(module):
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def test_parameter_names_and_shapes_are_megatrons(megatron_gdn):
    config = gdn_config()
    ours, theirs = gdn_layer(config), megatron_gdn(config)
    assert _shapes(ours) == _shapes(theirs)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    assert "in_proj.layer_norm_weight" in _shapes(ours)  # the TE layout's fused input norm


def test_spec_slots_are_megatrons():
    """Megatron's own GDN spec builder, given the NPU provider, fills the same three slots."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_gated_delta_net_module_spec,
    )

    from mcore_npu.transformer.gated_delta_net import gdn_attention_spec
    from mcore_npu.transformer.spec_provider import NPUSpecProvider

    provider = NPUSpecProvider(kernel="reference")
    theirs = get_gated_delta_net_module_spec(gdn_config(), backend=provider)
    ours = gdn_attention_spec(provider)
    assert list(vars(ours.submodules)) == list(vars(theirs.submodules))
    assert ours.submodules.in_proj.module is theirs.submodules.in_proj.module
    assert ours.metainfo == theirs.metainfo


def _sharded_entries(module, prefix="decoder.layers.0.self_attention."):
    """Every checkpoint entry ``key -> (global shape, global offset, local shape)``, factories
    built (what dist_checkpointing writes)."""
    state = module.sharded_state_dict(prefix=prefix)
    apply_factories(state)
    entries = {}

    def visit(value):
        if isinstance(value, list | tuple):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, ShardedTensor):
            entries[value.key] = (value.global_shape, value.global_offset, value.local_shape)
        elif isinstance(value, ShardedObject):
            entries[value.key] = ("object", value.global_shape, value.global_offset)

    visit(state)
    return entries


def test_sharded_state_dict_splits_are_megatrons(megatron_gdn):
    config = gdn_config()
    ours, theirs = _sharded_entries(gdn_layer(config)), _sharded_entries(megatron_gdn(config))
    assert ours == theirs
    prefix = "decoder.layers.0.self_attention."
    parts = ("query", "key", "value", "z", "beta", "alpha")
    assert {f"{prefix}in_proj.weight.{p}" for p in parts} <= set(ours)
    assert {f"{prefix}conv1d.weight.{p}" for p in parts[:3]} <= set(ours)
    assert ours[f"{prefix}in_proj.weight.beta"][2] == (config.linear_num_value_heads, 64)


@pytest.mark.parametrize("l2", [True, False])
def test_forward_and_gradients_equal_megatrons(megatron_gdn, l2):
    """Same weights, fp32: Megatron's torch path (deterministic_mode) and ours agree."""
    config = gdn_config(deterministic_mode=True)
    theirs = megatron_gdn(config)
    theirs.use_qk_l2norm = l2
    ours = gdn_layer(config)
    ours.use_qk_l2norm = l2
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(70, 2, 64, generator=torch.Generator().manual_seed(3))
    outs = []
    for module in (ours, theirs):
        xi = x.clone().requires_grad_()
        out, bias = module(xi, None)
        assert bias is None
        (out * torch.linspace(-1, 1, 64)).sum().backward()
        outs.append((out, xi.grad, {n: p.grad for n, p in module.named_parameters()}))
    (o1, dx1, g1), (o2, dx2, g2) = outs
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx1, dx2, rtol=1e-5, atol=1e-5)
    assert set(g1) == set(g2)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-5, msg=name)


def test_g_is_computed_in_fp32_from_a_bf16_a_log():
    """bf16 parameters: ``g = -exp(A_log) * softplus(alpha + dt_bias)`` is evaluated in fp32
    (transformers' numerics), not in bf16 (Megatron 0.16.1's ``A_log.exp()``)."""
    layer = gdn_layer(gdn_config(params_dtype=torch.bfloat16))
    seen = {}

    def rule(q, k, v, g, beta, bounds):
        seen["g"] = g
        return torch.zeros_like(v), None

    layer._rule = rule
    with torch.no_grad():
        layer.A_log.copy_(torch.tensor([2.7, 0.3, 1.9, 2.2]))
        layer.in_proj.weight[-layer.num_value_heads :] = 0  # alpha rows: alpha = 0
        layer(torch.randn(5, 1, 64, dtype=torch.bfloat16), None)
    a_log, dt_bias = layer.A_log.float(), layer.dt_bias.float()
    want = -a_log.exp() * torch.nn.functional.softplus(dt_bias)
    assert seen["g"].dtype == torch.float32
    torch.testing.assert_close(seen["g"][0, 0], want, rtol=0, atol=0)
    in_bf16 = -layer.A_log.exp() * torch.nn.functional.softplus(layer.dt_bias)
    assert (in_bf16.float() - want).abs().max() > 1e-3


def _packed(lengths, padded=None):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = None
    if padded is not None:
        cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))  # fmt: skip


@pytest.mark.parametrize("padding", [False, True])
def test_packed_segments_equal_each_sequence_alone(padding):
    """thd ``[t, 1, h]``: each segment's output and input gradient are those of the sequence
    run alone (sbhd, batch 1); the conv and the rule do not cross a boundary. With
    ``cu_seqlens_q_padded`` each segment ends in padding, which reaches no real token."""
    layer = gdn_layer()
    lengths = [5, 9, 14, 1]
    padded = [8, 12, 16, 4] if padding else None
    sizes = padded or lengths
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randn(n, 1, 64, generator=gen) for n in lengths]
    packed = torch.cat([torch.cat([s, torch.randn(p - s.shape[0], 1, 64, generator=gen)])
                        for s, p in zip(seqs, sizes, strict=True)]).requires_grad_()  # fmt: skip
    out, _ = layer(packed, None, packed_seq_params=_packed(lengths, padded))
    real = torch.cat([torch.arange(p) < n for n, p in zip(lengths, sizes, strict=True)])
    (out.square().sum(-1).squeeze(1) * real).sum().backward()  # the loss reads real tokens only
    start = 0
    for seq, size in zip(seqs, sizes, strict=True):
        alone = seq.clone().requires_grad_()
        want, _ = layer(alone, None)
        want.square().sum().backward()
        got = out[start : start + seq.shape[0]]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        dx = packed.grad[start : start + seq.shape[0]]
        torch.testing.assert_close(dx, alone.grad, rtol=1e-4, atol=1e-6)
        start += size


def test_packed_batch_differs_from_one_long_sequence():
    """The control: without the boundaries the same tokens give other outputs."""
    layer = gdn_layer()
    x = torch.randn(12, 1, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        packed, _ = layer(x, None, packed_seq_params=_packed([6, 6]))
        whole, _ = layer(x, None)
    torch.testing.assert_close(packed[:6], whole[:6])
    assert (packed[6:] - whole[6:]).abs().max() > 1e-3


def test_naive_l2norm_gives_the_kernel_l2norm_result():
    """``naive_l2norm`` normalises before the rule; the result equals the in-kernel l2norm."""
    layer = gdn_layer()
    x = torch.randn(10, 2, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        kernel, _ = layer(x, None)
        layer.naive_l2norm = True
        naive, _ = layer(x, None)
        layer.use_qk_l2norm = False
        none, _ = layer(x, None)
    torch.testing.assert_close(naive, kernel, rtol=1e-5, atol=1e-6)
    assert (none - kernel).abs().max() > 1e-4
