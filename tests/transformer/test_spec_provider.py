"""NPUSpecProvider through Megatron's own ``*_for_backend`` builders (real megatron-core)."""

from __future__ import annotations

import pytest

from mcore_npu.transformer.attention import NPUFusionAttention, TELayoutNPUFusionAttention
from mcore_npu.transformer.norm_linear import NormColumnParallelLinear
from mcore_npu.transformer.spec_provider import NPUSpecProvider
from tests.transformer.moe_models import module_of, submodules_of

pytestmark = pytest.mark.usefixtures("megatron_runtime")


def test_provider_is_a_megatron_backend_spec_provider():
    from megatron.core.models.backends import BackendSpecProvider

    assert BackendSpecProvider in NPUSpecProvider.__mro__  # an explicit subclass


@pytest.mark.parametrize("layout, fc1", [("te", NormColumnParallelLinear), ("local", None)])
def test_mlp_builder_takes_the_fused_linear_in_te_layout(layout, fc1):
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend as build
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    spec = build(backend=NPUSpecProvider(param_layout=layout, kernel="reference"), num_experts=None)
    linear_fc1 = submodules_of(spec).linear_fc1
    if fc1 is None:
        assert linear_fc1 is ColumnParallelLinear
    else:  # a spec: the fused norm carries the rms_norm kernel
        assert linear_fc1.module is fc1 and linear_fc1.params == {"norm_kernel": "reference"}


def test_moe_builder_gets_sequential_experts_and_refuses_grouped_ones():
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend as build

    provider = NPUSpecProvider(param_layout="te")
    spec = build(backend=provider, num_experts=2, moe_grouped_gemm=False)
    assert module_of(submodules_of(spec).experts).__name__ == "SequentialMLP"
    with pytest.raises(ValueError, match="moe_grouped_gemm"):
        build(backend=provider, num_experts=2, moe_grouped_gemm=True)


def test_core_attention_and_norms_follow_the_layout():
    te, local = NPUSpecProvider(kernel="reference"), NPUSpecProvider(param_layout="local")
    assert te.core_attention().module is TELayoutNPUFusionAttention
    assert local.core_attention().module is NPUFusionAttention
    assert te.core_attention().params["kernel"] == "reference"
    assert te.layer_norm().params == {"extra_state": True, "kernel": "reference"}
    assert local.layer_norm().params == {"extra_state": False, "kernel": "auto"}
    off = NPUSpecProvider(rms_norm_kernel="off")
    assert off.layer_norm().params == {"extra_state": True, "kernel": None}
    assert (te.fuse_layernorm_and_linear(), local.fuse_layernorm_and_linear()) == (True, False)
    with pytest.raises(ValueError, match="param_layout: unknown layout"):
        NPUSpecProvider(param_layout="megatron")


BAD_OPTIONS = {
    "kernel": "npu",
    "param_layout": "megatron",
    "rms_norm_kernel": "fused",
    "swiglu_kernel": "fused",
    "grouped_matmul_kernel": "fused",
    "moe_permute_kernel": "fused",
    "rope_kernel": "fused",
    "mla_value_padding": "maybe",
    "batch_invariant": "yes",
    "dsa_indexer_rope_interleaved": "yes",
    "mla_latent_norm_epsilon": -1.0,
    "dsa_indexer_k_norm_epsilon": "small",
    "dsa_indexer_topk_freq": 0,
    "dsa_indexer_skip_topk_offset": -1,
    "lightning_indexer_kernel": "fused",
    "sparse_attention_kernel": "fused",
    "indexer_loss_kernel": "fused",
}


def _builders():
    from mcore_npu.transformer import layer_specs
    from tests.transformer.megatron_models import tiny_config

    config = tiny_config()
    block = layer_specs.get_gpt_decoder_block_npu_spec(config, kernel="reference")
    return {
        "layer": lambda **o: layer_specs.get_gpt_layer_npu_spec(**o),
        "block": lambda **o: layer_specs.get_gpt_decoder_block_npu_spec(config, **o),
        "mtp": lambda **o: layer_specs.get_gpt_mtp_block_npu_spec(config, block, **o),
        "provider": lambda **o: NPUSpecProvider(**o),
    }


def test_every_builder_takes_every_option_and_refuses_a_bad_one_by_name():
    from mcore_npu.transformer.spec_provider import OPTION_NAMES

    assert set(BAD_OPTIONS) == set(OPTION_NAMES)
    for build in _builders().values():
        for option, bad in BAD_OPTIONS.items():
            with pytest.raises(ValueError, match=f"^{option}: .*{bad!r}"):
                build(**{option: bad})
        build(**{option: None for option in OPTION_NAMES if option.endswith("_kernel")})


def test_the_options_are_checked_once_per_spec(monkeypatch):
    """One check of ``kernel`` and of ``param_layout`` per built block spec (not one per
    builder, provider and layer)."""
    from mcore_npu.transformer import layer_specs, spec_provider
    from tests.transformer.megatron_models import tiny_config

    calls = []
    for name in ("check_kernel", "check_param_layout"):
        real = getattr(spec_provider, name)
        monkeypatch.setattr(
            spec_provider, name, lambda v, real=real, n=name: calls.append(n) or real(v)
        )
    layer_specs.get_gpt_decoder_block_npu_spec(tiny_config(), kernel="reference", param_layout="te")
    assert sorted(calls) == ["check_kernel", "check_param_layout"]


def test_options_and_keywords_do_not_mix():
    from mcore_npu.transformer.spec_provider import NPUSpecOptions

    with pytest.raises(TypeError, match="kernel: pass options or keywords, not both"):
        NPUSpecProvider(NPUSpecOptions(), kernel="reference")
    assert NPUSpecProvider(NPUSpecOptions(kernel="reference")).fused["swiglu"] == "reference"
