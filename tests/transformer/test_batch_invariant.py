"""Batch-invariant mode in the NPU spec (``batch_invariant=True``): every core attention goes to
``batch_invariant_attention`` and every matmul of a layer to ``batch_invariant_linear``; the
mode's limits and its missing NPU kernels are refused when the layers are built, one line each;
on stand-ins of ``flash_attn_npu`` and vllm-ascend's ``batch_invariant_ops`` (no NPU here) the
model's calls are the fixed-split attention kernels with MindSpeed's arguments and the AscendC
batch-invariant matmuls."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mcore_npu.transformer.attention import NPUFusionAttention
from mcore_npu.transformer.batch_invariant import (
    KERNEL,
    BatchInvariantColumnParallelLinear,
    BatchInvariantRowParallelLinear,
    BatchInvariantTopKRouter,
    make_batch_invariant,
)
from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec
from mcore_npu.transformer.vocab_parallel import vocab_parallel_log_probs
from tests import batch_invariant_ops_standin
from tests.flash_attn_npu_standin import install
from tests.megatron_features import GDN_CONFIG_FIELDS, needs_fields
from tests.transformer.megatron_models import VOCAB, batch, gpt, tiny_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]


def _spec(config, *, kernel="reference", batch_invariant=True):
    return get_gpt_layer_npu_spec(
        normalization=config.normalization, qk_layernorm=config.qk_layernorm, kernel=kernel,
        param_layout="local", rms_norm_kernel="reference", swiglu_kernel="reference",
        grouped_matmul_kernel="reference", batch_invariant=batch_invariant,
    )  # fmt: skip


def _core_attentions(model):
    return [m for m in model.modules() if isinstance(m, NPUFusionAttention)]


def test_the_spec_switch_reaches_every_core_attention_and_linear():
    config = tiny_config()
    on, off = gpt(config, _spec(config)), gpt(config, _spec(config, batch_invariant=False))
    assert [a.batch_invariant for a in _core_attentions(on)] == [True, True]
    assert [a.batch_invariant for a in _core_attentions(off)] == [False, False]
    invariant = (BatchInvariantColumnParallelLinear, BatchInvariantRowParallelLinear)
    names = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    for model, expected in ((on, True), (off, False)):
        linears = {n: m for n, m in model.decoder.named_modules() if n.endswith(names)}
        assert len(linears) == 4 * config.num_layers
        assert {isinstance(m, invariant) for m in linears.values()} == {expected}
    assert on.state_dict().keys() == off.state_dict().keys()  # the same parameters and names


def test_a_moe_model_in_the_mode_routes_its_router_and_experts_and_is_invariant():
    config = tiny_config(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                         moe_shared_expert_intermediate_size=32)  # fmt: skip
    spec = get_gpt_layer_npu_spec(
        normalization="RMSNorm", qk_layernorm=True, kernel="reference", param_layout="local",
        num_experts=4, moe_grouped_gemm=False, batch_invariant=True,
    )  # fmt: skip
    model = gpt(config, spec).eval()
    routers = [m for m in model.modules() if isinstance(m, BatchInvariantTopKRouter)]
    experts = [m for m in model.modules() if hasattr(m, "batch_invariant_kernel")
               and type(m).__name__ == "NPUGroupedMLP"]  # fmt: skip
    assert len(routers) == len(experts) == config.num_layers
    assert {e.batch_invariant_kernel for e in experts} == {"reference"}
    shared = [m for n, m in model.named_modules() if ".shared_experts.linear_fc" in n]
    assert len(shared) == 2 * config.num_layers
    assert all(isinstance(m, (BatchInvariantColumnParallelLinear, BatchInvariantRowParallelLinear))
               for m in shared)  # fmt: skip
    ids, _ = batch(b=3, s=24)
    with torch.no_grad():
        padded = model(ids, torch.arange(24).expand(3, 24), None)
        for row, n in enumerate((24, 9, 17)):
            alone = model(ids[row : row + 1, :n], torch.arange(n)[None], None)
            assert torch.equal(padded[row, :n], alone[0])


def test_logits_of_a_sequence_alone_and_right_padded_among_others_are_equal():
    config = tiny_config()
    model = gpt(config, _spec(config)).eval()
    ids, _ = batch(b=3, s=24)
    lengths = (24, 9, 17)
    with torch.no_grad():
        padded = model(ids, torch.arange(24).expand(3, 24), None)
        for row, n in enumerate(lengths):
            alone = model(ids[row : row + 1, :n], torch.arange(n)[None], None)
            assert torch.equal(padded[row, :n], alone[0])


def test_on_an_npu_stand_in_the_model_calls_flash_attn_func_and_the_ascendc_matmuls(monkeypatch):
    config = tiny_config()
    standin = install(monkeypatch)
    library = batch_invariant_ops_standin.install(monkeypatch)
    model = gpt(config, _spec(config, kernel="torch_npu"))
    make_batch_invariant(model.output_layer, KERNEL["torch_npu"])  # as the verl engine does
    ids, pos = batch(b=2, s=8)
    logits = model(ids, pos, None)
    log_probs = vocab_parallel_log_probs(logits, ids, kernel=KERNEL["torch_npu"])
    log_probs.sum().backward()
    assert [name for name, _, _ in standin.calls] == ["flash_attn_func"] * config.num_layers
    head_dim = config.hidden_size // config.num_attention_heads
    for _, (q, k, v), kwargs in standin.calls:
        assert q.shape == (2, 8, config.num_attention_heads, head_dim)  # [b, s, n, d]
        assert k.shape == v.shape == (2, 8, config.num_query_groups, head_dim)
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert kwargs["causal"] is True and kwargs["dropout_p"] == 0.0
        assert kwargs["softmax_scale"] == pytest.approx(head_dim**-0.5)
        assert kwargs["window_size"] == (-1, -1) and kwargs["deterministic"] is False
    # qkv, proj, fc1, fc2 per layer, the output layer, the log-probs' one sum; forward only
    matmul, total = "npu_matmul_batch_invariant", "npu_reduce_sum_batch_invariant"
    assert [name for name, _ in library.calls] == [matmul] * (4 * 2 + 1) + [total]
    widths = [b.shape[1] for _, (a, b) in library.calls[:-1]]
    qkv = config.hidden_size + 2 * config.num_query_groups * config.kv_channels
    layer = [qkv, config.hidden_size, 2 * config.ffn_hidden_size, config.hidden_size]
    assert widths == layer * 2 + [VOCAB]
    for _, (a, b) in library.calls[:-1]:
        assert a.dim() == b.dim() == 2 and a.shape == (8 * 2, b.shape[0])  # [s*b, K] x [K, N]
    _, (exps, dim, keepdim) = library.calls[-1]
    assert exps.shape == (2 * 8, VOCAB) and dim == 1 and keepdim is False  # rows [T, V]


def test_the_output_layer_made_batch_invariant_keeps_its_state_and_answers():
    config = tiny_config()
    model = gpt(config, _spec(config))
    head = model.output_layer
    before = {k: v.clone() for k, v in head.state_dict().items() if v is not None}
    x = torch.randn(5, 2, config.hidden_size)
    want, _ = head(x)
    make_batch_invariant(head, "reference")
    assert isinstance(head, BatchInvariantColumnParallelLinear)
    got, _ = head(x)
    assert (got - want).abs().max() < 1e-5
    after = head.state_dict()
    assert after.keys() == before.keys() | {k for k, v in after.items() if v is None}
    assert all(torch.equal(after[k], v) for k, v in before.items())
    with pytest.raises(TypeError, match="^linear: expected Megatron's ColumnParallelLinear"):
        make_batch_invariant(head, "reference")  # already made: refused, not stacked


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (dict(attention_dropout=0.1), "attention_dropout=0.1: use 0.0"),
        (dict(kv_channels=320), "head dim 320 > 256"),
        (dict(window_size=(4, 0)), "window_size=(4, 0) (sliding window)"),
    ],
)
def test_the_modes_limits_are_refused_when_the_layers_are_built(overrides, fragment):
    config = tiny_config(**overrides)
    with pytest.raises(ValueError, match="^batch-invariant mode does not support ") as error:
        gpt(config, _spec(config))
    assert fragment in str(error.value) and "\n" not in str(error.value)
    gpt(config, _spec(config, batch_invariant=False))  # the mode off builds


def test_on_an_npu_without_flash_attn_npu_the_build_refuses_naming_the_package(monkeypatch):
    monkeypatch.setattr("mcore_npu.allocator.device.is_npu_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flash_attn_npu", None)  # its import fails
    config = tiny_config()
    message = _refused_build(config)
    assert message.startswith("batch-invariant mode on an NPU needs flash_attn_npu (")
    assert "install flash-attention-npu (pip install flash-attention-npu)" in message
    install(monkeypatch)  # installed: the matmuls' library is asked for next
    message = _refused_build(config)
    assert message.startswith("batch-invariant mode on an NPU needs batch_invariant_ops for its ")
    assert "install vllm-ascend built with VLLM_BATCH_INVARIANT=1" in message
    batch_invariant_ops_standin.install(monkeypatch)  # both installed: it builds
    gpt(config, _spec(config))


def _refused_build(config) -> str:
    """The one-line ImportError of building the model in the mode."""
    with pytest.raises(ImportError) as error:
        gpt(config, _spec(config))
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_value_head_dim_other_than_the_querys_is_refused_in_one_line():
    """Multi-Latent Attention's v (Dv < D): neither kernel of the mode is called with it."""
    from megatron.core.transformer.enums import AttnMaskType

    config = tiny_config()
    layer = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, k_channels=24)
    with pytest.raises(ValueError, match=r"^batch-invariant mode does not support a value head "
                       r"dim \(16\) other than the query's \(24\)"):  # fmt: skip
        NPUFusionAttention(config, **layer, v_channels=16, batch_invariant=True)
    NPUFusionAttention(config, **layer, v_channels=24, batch_invariant=True)


@needs_fields(*GDN_CONFIG_FIELDS, feature="Gated DeltaNet")
def test_layers_without_a_batch_invariant_kernel_are_refused_in_one_line():
    """Gated DeltaNet's delta rule and the hybrid stack's Mamba scan have no batch-invariant
    kernel: the spec builders refuse the mode for them rather than run them unchanged."""
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec
    from mcore_npu.transformer.mamba.spec import get_hybrid_stack_npu_spec
    from tests.transformer.gdn_models import gdn_config

    config = gdn_config()
    with pytest.raises(ValueError, match="^batch-invariant mode does not support Gated DeltaNet"):
        get_gpt_decoder_block_npu_spec(config, kernel="reference", batch_invariant=True)
    get_gpt_decoder_block_npu_spec(config, kernel="reference")  # the mode off builds
    with pytest.raises(ValueError, match="^batch_invariant: .* the hybrid stack's Mamba layers"):
        get_hybrid_stack_npu_spec(kernel="reference", batch_invariant=True)


def test_a_one_row_batch_trains_with_verls_in_place_temperature_division():
    """verl divides the logits by the temperature in place; with one row the logits GPTModel
    returns are a view of the output layer's answer, which must not be a view made inside the
    operator's autograd Function (PyTorch refuses in-place writes to those)."""
    config = tiny_config()
    model = gpt(config, _spec(config))
    make_batch_invariant(model.output_layer, "reference")
    ids, pos = batch(b=1, s=8)
    logits = model(ids, pos, None)
    logits.div_(0.7)
    vocab_parallel_log_probs(logits, ids).sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_what_the_mode_cannot_route_is_refused_in_one_line():
    """Megatron's legacy GroupedMLP (local layout, grouped experts), DSA layers, a shared-expert
    gate, deferred embedding gradients and a parallel linear of an unknown class."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.moe import experts
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mcore_npu.transformer.batch_invariant import route_linears

    cases = (
        [
            (
                lambda: get_gpt_layer_npu_spec(
                    num_experts=4, moe_grouped_gemm=True, param_layout="local", batch_invariant=True
                ),
                "GroupedMLP",
            ),  # fmt: skip
        ]
        if hasattr(experts, "GroupedMLP")
        else []
    )  # 0.19: that slot is SequentialMLP's, routed
    cases += [
        (
            lambda: BatchInvariantColumnParallelLinear(  # Qwen2-MoE's gate (0.16+ configs)
                8, 8, config=types.SimpleNamespace(moe_shared_expert_gate=True), init_method=None
            ),
            "moe_shared_expert_gate=True",
        ),  # fmt: skip
        (
            lambda: BatchInvariantColumnParallelLinear(  # a config Megatron allows under PP only
                8,
                8,
                config=types.SimpleNamespace(defer_embedding_wgrad_compute=True),
                init_method=None,
            ),
            "defer_embedding_wgrad_compute=True",
        ),  # fmt: skip
        (
            lambda: route_linears(
                ModuleSpec(module=type("Mine", (ColumnParallelLinear,), {})), "reference"
            ),
            "cannot route the matmul of Mine",
        ),  # fmt: skip
    ]
    for build, fragment in cases:
        with pytest.raises(ValueError, match="^batch-invariant mode") as error:
            build()
        assert fragment in str(error.value) and "\n" not in str(error.value), error.value


def test_the_mtp_layers_linears_are_batch_invariant_too():
    from mcore_npu.transformer.layer_specs import (
        get_gpt_decoder_block_npu_spec,
        get_gpt_mtp_block_npu_spec,
    )

    config = tiny_config(mtp_num_layers=1)
    block = get_gpt_decoder_block_npu_spec(config, kernel="reference", batch_invariant=True)
    mtp = get_gpt_mtp_block_npu_spec(config, block, kernel="reference", batch_invariant=True)
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(0)
    model = GPTModel(config, transformer_layer_spec=block, vocab_size=VOCAB,
                     max_sequence_length=64, mtp_block_spec=mtp)  # fmt: skip
    (layer,) = model.mtp.layers
    assert isinstance(layer.eh_proj, BatchInvariantColumnParallelLinear)
    (qkv,) = [m for n, m in layer.named_modules() if n.endswith("linear_qkv")]  # te layout's
    assert type(qkv).__name__ == "BatchInvariantNormColumnParallelLinear"
