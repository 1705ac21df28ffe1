"""The hybrid GDN block from ``get_gpt_decoder_block_npu_spec``: Megatron's pattern reading,
pipeline stages, both parameter layouts, recompute, checkpoints, the config subclass and the
one-line refusals."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_npu.transformer.attention import NPUFusionAttention
from mcore_npu.transformer.gated_delta_net import NPUGatedDeltaNet, linear_attention_pattern
from tests.megatron_features import GDN_CONFIG_FIELDS, needs_fields
from tests.transformer.gdn_models import (
    GDN_FIELDS,
    gdn_block,
    gdn_config,
    gdn_gpt,
    gdn_layer,
    loss_and_grads,
    tokens,
)

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime"),
              needs_fields(*GDN_CONFIG_FIELDS, feature="Gated DeltaNet")]  # fmt: skip


def _kinds(block) -> list[str]:
    return [
        "gdn" if spec.submodules.self_attention.module is NPUGatedDeltaNet else "attn"
        for spec in block.layer_specs
    ]


@pytest.mark.parametrize(
    ("freq", "layers", "want"),
    [
        (4, 8, [1, 1, 1, 0, 1, 1, 1, 0]),
        (2, 4, [1, 0, 1, 0]),
        (1, 3, [0, 0, 0]),
        ([0, 1, 1, 0], 4, [0, 1, 1, 0]),
    ],
)
def test_pattern_is_megatrons_reading(freq, layers, want):
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
    )

    config = gdn_config(num_layers=layers, linear_attention_freq=freq)
    assert linear_attention_pattern(config) == want
    assert linear_attention_pattern(config) == get_linear_attention_pattern(config)


@pytest.mark.parametrize("layout", ["te", "local"])
def test_block_follows_the_pattern_in_both_layouts(layout):
    block = gdn_block(gdn_config(linear_attention_freq=[1, 0, 1, 1]), param_layout=layout)
    assert _kinds(block) == ["gdn", "attn", "gdn", "gdn"]
    attn = block.layer_specs[1].submodules.self_attention.submodules.core_attention
    assert issubclass(attn.module, NPUFusionAttention)  # full attention keeps the NPU operator
    norm = block.layer_specs[0].submodules.input_layernorm
    assert (getattr(norm, "__name__", "") == "IdentityOp") == (layout == "te")


@pytest.mark.parametrize(
    ("stages", "want"),
    [
        (dict(pipeline_model_parallel_size=2), [["gdn", "gdn"], ["gdn", "attn"]]),
        (
            dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=3),
            [["gdn", "gdn", "gdn"], ["attn"]],
        ),
    ],
)
def test_pipeline_stages_read_the_pattern_at_global_positions(stages, want):
    config = gdn_config(**stages, pipeline_dtype=torch.float32)
    got = [_kinds(gdn_block(config, pp_rank=rank)) for rank in range(2)]
    assert got == want


def test_pipeline_layout_string_places_the_pattern():
    config = gdn_config(
        num_layers=4, linear_attention_freq=2, pipeline_model_parallel_size=2,
        pipeline_model_parallel_layout="Et|tttL", pipeline_dtype=torch.float32,
    )  # fmt: skip
    got = [_kinds(gdn_block(config, pp_rank=rank)) for rank in range(2)]
    assert got == [["gdn"], ["attn", "gdn", "attn"]]


@pytest.mark.parametrize("layout", ["te", "local"])
def test_hybrid_moe_model_trains_a_step(layout):
    """A hybrid MoE (every layer's MLP an MoE) builds, runs and gives finite gradients to every
    GDN parameter."""
    config = gdn_config(
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
        moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss",
    )  # fmt: skip
    model = gdn_gpt(config, layout)
    loss, grads = loss_and_grads(model, *tokens())
    assert torch.isfinite(loss)
    gdn = [n for n in grads if ".self_attention.A_log" in n or ".self_attention.conv1d" in n]
    assert len(gdn) == 6  # three GDN layers x (A_log, conv1d.weight)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())


RECOMPUTE = {
    "full-uniform": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "full-block": dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=3
    ),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
}


@pytest.mark.parametrize("name", list(RECOMPUTE))
def test_recompute_gives_the_same_loss_and_gradients(name):
    ids, positions = tokens()
    want = loss_and_grads(gdn_gpt(gdn_config()), ids, positions)
    model = gdn_gpt(gdn_config(**RECOMPUTE[name]))
    model.train()
    got = loss_and_grads(model, ids, positions)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    assert set(got[1]) == set(want[1])
    for key in want[1]:
        torch.testing.assert_close(got[1][key], want[1][key], rtol=1e-5, atol=1e-7, msg=key)


def test_selective_recompute_checkpoints_the_gdn_core():
    """The control for the test above: with "core_attn" the GDN core runs twice per step."""
    layer = gdn_layer(gdn_config(recompute_granularity="selective"))
    calls = []
    inner = layer._mix
    layer._mix = lambda *args: calls.append(1) or inner(*args)
    layer.train()
    out, _ = layer(torch.randn(6, 1, 64, requires_grad=True), None)
    out.sum().backward()
    assert len(calls) == 2


@pytest.mark.parametrize(("saved", "loaded"), [("te", "te"), ("te", "local"), ("local", "te")])
def test_dist_checkpoint_round_trip(tmp_path, saved, loaded):
    """Real dist_checkpointing: a hybrid model saved in one layout loads into a freshly
    initialised one (same or other layout) bit for bit: every parameter and the logits."""
    from mcore_npu.training import checkpointing

    source = gdn_gpt(gdn_config(), saved, seed=1)
    target = gdn_gpt(gdn_config(), loaded, seed=2)
    path = checkpointing.save({"model": source.sharded_state_dict()}, tmp_path, 1)
    state = checkpointing.match_layout(target.sharded_state_dict(), path)
    target.load_state_dict(checkpointing.load({"model": state}, path)["model"], strict=False)
    ids, positions = tokens()
    with torch.no_grad():
        want, got = source(ids, positions, None), target(ids, positions, None)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if saved == loaded:
        for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


def test_checkpoint_keys_are_the_split_names(tmp_path):
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from mcore_npu.training import checkpointing

    path = checkpointing.save({"model": gdn_gpt().sharded_state_dict()}, tmp_path, 1)
    keys = set(load_sharded_metadata(str(path)))
    prefix = "decoder.layers.0.self_attention."  # a hybrid's layers are not stacked
    for part in ("query", "key", "value", "z", "beta", "alpha"):
        assert f"{prefix}in_proj.weight.{part}" in keys
    for part in ("query", "key", "value"):
        assert f"{prefix}conv1d.weight.{part}" in keys
    assert {f"{prefix}A_log", f"{prefix}dt_bias", f"{prefix}out_norm.weight"} <= keys
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in keys  # full attention


def test_config_subclass_admits_context_parallel():
    """Megatron's own config refuses GDN under CP where its GDN has no context parallelism
    (megatron-core 0.16 / 0.17); 0.18+'s GDN splits heads over CP ranks itself (its
    ``tensor_a2a_cp2hp``) and its config admits it. The subclass checks and admits it on all."""
    from megatron.core.ssm import gated_delta_net

    fields = dict(num_layers=4, hidden_size=64, num_attention_heads=4, context_parallel_size=2)
    if hasattr(gated_delta_net, "tensor_a2a_cp2hp"):
        assert TransformerConfig(**fields, **GDN_FIELDS).context_parallel_size == 2
    else:
        with pytest.raises(AssertionError, match="context parallel"):
            TransformerConfig(**fields, **GDN_FIELDS)
    config = gdn_config(context_parallel_size=2)
    assert config.experimental_attention_variant == "gated_delta_net"
    assert isinstance(config, TransformerConfig)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (dict(linear_attention_freq=None), "linear_attention_freq: None"),
        (dict(linear_num_value_heads=3), "linear_num_value_heads: 3 is not a multiple"),
        (dict(linear_key_head_dim=0), "linear_key_head_dim: 0"),
        (
            dict(context_parallel_size=4),
            "linear_num_key_heads: 2 heads do not split over .* 4 ranks",
        ),
    ],
)
def test_config_refusals_name_the_field(fields, words):
    with pytest.raises(ValueError, match=words):
        gdn_config(**fields)


@pytest.mark.parametrize(
    ("build", "error", "words"),
    [
        (lambda: gdn_block(gdn_config(linear_attention_freq=[1, 0])), ValueError,
         r"linear_attention_freq: \[1, 0\]; a list needs num_layers = 4"),
        (lambda: gdn_block(gdn_config(linear_attention_freq=[1, 2, 1, 0])), ValueError,
         "each 0 .full attention. or 1"),
        (lambda: gdn_layer(gdn_config(activation_func=torch.nn.functional.gelu)), ValueError,
         "activation_func: 'gelu'"),
    ],
)  # fmt: skip
def test_spec_refusals_are_one_line(build, error, words):
    with pytest.raises(error, match=words) as caught:
        build()
    assert "\n" not in str(caught.value)


def test_layer_refusals_are_one_line():
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection

    from mcore_npu.transformer.gated_delta_net import NPUGatedDeltaNetSubmodules

    layer = gdn_layer()
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    cases = [
        (lambda: layer(torch.randn(6, 2, 64), None, packed_seq_params=packed), ValueError,
         "thd expects the packed tokens as .t, 1, h., got batch 2"),
        (lambda: layer(torch.randn(4, 1, 64), None, packed_seq_params=packed), ValueError,
         r"cu_seqlens_q: \[0, 3, 6\] does not cut the 4 packed tokens"),
        (lambda: layer(torch.randn(6, 1, 64), None, inference_context=object()),
         NotImplementedError, "no recurrent-state cache"),
        (lambda: NPUGatedDeltaNet(gdn_config(), NPUGatedDeltaNetSubmodules(), conv_bias=True,
                                  pg_collection=ProcessGroupCollection.use_mpu_process_groups()),
         ValueError, "conv_bias: True is not supported"),
    ]  # fmt: skip
    for call, error, words in cases:
        with pytest.raises(error, match=words) as caught:
            call()
        assert "\n" not in str(caught.value)
