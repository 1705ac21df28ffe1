"""Batch-invariant mode in the NPU spec (``batch_invariant=True``): every core attention goes to
``batch_invariant_attention``; the mode's limits and its missing NPU kernel are refused when the
layers are built, one line each; on a stand-in ``flash_attn_npu`` the model's calls are the
fixed-split kernels with MindSpeed's arguments."""

from __future__ import annotations

import sys

import pytest
import torch

from mcore_npu.transformer.attention import NPUFusionAttention
from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec
from tests.flash_attn_npu_standin import install
from tests.transformer.megatron_models import batch, gpt, tiny_config

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]


def _spec(config, *, kernel="reference", batch_invariant=True):
    return get_gpt_layer_npu_spec(
        normalization=config.normalization, qk_layernorm=config.qk_layernorm, kernel=kernel,
        param_layout="local", rms_norm_kernel="reference", swiglu_kernel="reference",
        grouped_matmul_kernel="reference", batch_invariant=batch_invariant,
    )  # fmt: skip


def _core_attentions(model):
    return [m for m in model.modules() if isinstance(m, NPUFusionAttention)]


def test_the_spec_switch_reaches_every_core_attention():
    config = tiny_config()
    on, off = gpt(config, _spec(config)), gpt(config, _spec(config, batch_invariant=False))
    assert [a.batch_invariant for a in _core_attentions(on)] == [True, True]
    assert [a.batch_invariant for a in _core_attentions(off)] == [False, False]


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


def test_on_an_npu_stand_in_the_model_calls_flash_attn_func(monkeypatch):
    config = tiny_config()
    standin = install(monkeypatch)
    model = gpt(config, _spec(config, kernel="torch_npu"))
    ids, pos = batch(b=2, s=8)
    model(ids, pos, None).float().square().mean().backward()
    assert [name for name, _, _ in standin.calls] == ["flash_attn_func"] * config.num_layers
    head_dim = config.hidden_size // config.num_attention_heads
    for _, (q, k, v), kwargs in standin.calls:
        assert q.shape == (2, 8, config.num_attention_heads, head_dim)  # [b, s, n, d]
        assert k.shape == v.shape == (2, 8, config.num_query_groups, head_dim)
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert kwargs["causal"] is True and kwargs["dropout_p"] == 0.0
        assert kwargs["softmax_scale"] == pytest.approx(head_dim**-0.5)
        assert kwargs["window_size"] == (-1, -1) and kwargs["deterministic"] is False


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
    with pytest.raises(ImportError) as error:
        gpt(config, _spec(config))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("batch-invariant mode on an NPU needs flash_attn_npu (")
    assert "install flash-attention-npu (pip install flash-attention-npu)" in message
    install(monkeypatch)  # installed: it builds
    gpt(config, _spec(config))


def test_a_value_head_dim_other_than_the_querys_is_refused_in_one_line():
    """Multi-Latent Attention's v (Dv < D): neither kernel of the mode is called with it."""
    from megatron.core.transformer.enums import AttnMaskType

    config = tiny_config()
    layer = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, k_channels=24)
    with pytest.raises(ValueError, match=r"^batch-invariant mode does not support a value head "
                       r"dim \(16\) other than the query's \(24\)"):  # fmt: skip
        NPUFusionAttention(config, **layer, v_channels=16, batch_invariant=True)
    NPUFusionAttention(config, **layer, v_channels=24, batch_invariant=True)
