"""config -> TransformerConfig + spec -> GPTModel: the built model is what the YAML says."""

from __future__ import annotations

import pytest
import torch

from mcore_npu.ops import KERNELS
from mcore_npu.training import config as config_module
from mcore_npu.training.config import load_config
from mcore_npu.training.model import build_model, transformer_config
from mcore_npu.transformer.attention import NPUFusionAttention
from mcore_npu.transformer.norm_linear import NormColumnParallelLinear
from tests.launch import ROOT

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("megatron_runtime")]

GPT_TINY = ROOT / "configs" / "gpt_tiny.yaml"


def test_model_built_from_gpt_tiny_matches_the_yaml():
    cfg = load_config(GPT_TINY)
    model = build_model(cfg)
    config = model.config
    assert (config.num_layers, config.hidden_size) == (2, 128)
    assert (config.num_attention_heads, config.num_query_groups) == (4, 2)
    assert config.ffn_hidden_size == 384  # swiglu: 8/3 * 128 rounded up to a multiple of 64
    assert config.gated_linear_unit and config.activation_func is torch.nn.functional.silu
    assert config.qk_layernorm and config.normalization == "RMSNorm"
    assert len(model.decoder.layers) == 2
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.core_attention, NPUFusionAttention)
    from mcore_npu.transformer.norms import NPURMSNorm  # RMSNorm through npu_rms_norm

    # model.param_layout defaults to te: the input norm lives in linear_qkv (layer_norm_weight)
    assert isinstance(layer.self_attention.linear_qkv, NormColumnParallelLinear)
    assert layer.self_attention.linear_qkv.normalization == "RMSNorm"
    assert isinstance(model.decoder.final_layernorm, NPURMSNorm)
    # the fused norm and the final norm run the same npu_rms_norm kernel (fused.rms_norm)
    assert layer.self_attention.linear_qkv.norm_kernel == model.decoder.final_layernorm.kernel
    assert model.position_embedding_type == "rope"
    assert model.embedding.word_embeddings.weight.shape == (264, 128)
    assert model.output_layer.weight.shape == (264, 128)  # untied output layer


def test_model_section_passthrough_reaches_transformer_config():
    cfg = load_config(GPT_TINY, ["model.layernorm_epsilon=1e-6", "model.window_size=[8,0]"])
    config = transformer_config(cfg)
    assert config.layernorm_epsilon == 1e-6 and config.window_size == (8, 0)


def test_param_layout_local_keeps_the_local_names():
    model = build_model(load_config(GPT_TINY, ["model.param_layout=local"]))
    names = {name for name, _ in model.named_parameters()}
    assert "decoder.layers.0.input_layernorm.weight" in names
    assert not any("layer_norm_weight" in name for name in names)


def test_local_backend_builds_megatron_local_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    model = build_model(load_config(GPT_TINY, ["attention.backend=local"]))
    assert type(model.decoder.layers[0].self_attention.core_attention) is DotProductAttention


def test_config_kernel_names_are_the_dispatch_kernel_names():
    assert config_module.KERNELS == KERNELS
