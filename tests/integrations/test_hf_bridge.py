"""Hugging Face weights through mbridge's AutoBridge into the NPU spec (TE layout), on the CPU.

Dense families (Llama, Qwen2, Qwen3) and MoE families (Qwen3-MoE, Mixtral: 4 experts, top-2, the
experts as ``NPUGroupedMLP`` with TEGroupedMLP's names ``linear_fc1.weight{e}``).

Needs the verl test environment (mbridge, transformers, safetensors): skipped elsewhere. Real
transformers models saved as safetensors, the real AutoBridge, real megatron-core on one gloo
process; the attention kernel is the reference.
"""

from __future__ import annotations

import pytest
import torch

mbridge = pytest.importorskip("mbridge")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("cpu_runtime")]

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
MOE = dict(hidden_act="silu", moe_intermediate_size=32, num_experts_per_tok=2)
FAMILIES = {  # GQA, RoPE, RMSNorm, SwiGLU; qkv bias for Qwen2, q/k norm for Qwen3
    "llama": lambda: transformers.LlamaConfig(**COMMON, hidden_act="silu"),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, hidden_act="silu"),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16, hidden_act="silu"),
    # MoE: every layer sparse, 4 experts of width 32, top-2, softmax router
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, **MOE, head_dim=16, num_experts=4, norm_topk_prob=True),
    "qwen3_moe_unnormalised": lambda: transformers.Qwen3MoeConfig(  # top-k weights kept as is
        **COMMON, **MOE, head_dim=16, num_experts=4, norm_topk_prob=False),
    "mixtral": lambda: transformers.MixtralConfig(
        **{**COMMON, "intermediate_size": 32}, **MOE, num_local_experts=4),
}  # fmt: skip
MOE_FAMILIES = ["qwen3_moe", "qwen3_moe_unnormalised", "mixtral"]
CPU_ARGS = dict(use_cpu_initialization=True, masked_softmax_fusion=False,
                bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                gradient_accumulation_fusion=False, variable_seq_lengths=False)  # fmt: skip


def _hf_checkpoint(family: str, path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family]())
    with torch.no_grad():  # norms away from 1 and biases away from 0, so a dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def _npu_model(path):
    from mcore_npu.integrations.hf import npu_bridge

    bridge = npu_bridge(str(path), kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**CPU_ARGS)
    return bridge, build_and_load(bridge, path)


def build_and_load(bridge, path):
    from mcore_npu.integrations.hf import build_model, load_hf_weights

    model = build_model(bridge).eval()
    load_hf_weights(model, str(path), bridge=bridge)
    return model


def _logits(model):
    """``[2, 24, 128]`` logits of a fixed batch, from a transformers or a Megatron model."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if isinstance(model, transformers.PreTrainedModel):
            return model(input_ids=ids).logits
        return model(ids, torch.arange(24).expand(2, 24), None)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_and_export_is_bit_exact(tmp_path, family):
    from mcore_npu.integrations.hf import export_hf_weights
    from mcore_npu.transformer.norm_linear import NormColumnParallelLinear

    hf = _hf_checkpoint(family, tmp_path)
    bridge, model = _npu_model(tmp_path)
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, NormColumnParallelLinear)  # TE layout
    assert type(layer.self_attention.core_attention).__name__ == "TELayoutNPUFusionAttention"
    if family in MOE_FAMILIES:  # TEGroupedMLP's names on the grouped-matmul experts
        assert type(layer.mlp.experts).__name__ == "NPUGroupedMLP"
        assert "decoder.layers.1.mlp.experts.linear_fc2.weight3" in model.state_dict()

    want, got = _logits(hf), _logits(model)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    saved = safetensors_torch.load_file(str(next(tmp_path.glob("*.safetensors"))))
    exported = dict(export_hf_weights(model, bridge))
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(exported[name].cpu(), tensor), name


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_one_expert_weight_moves_the_logits_and_its_export(tmp_path, family):
    """The checks above can fail: one expert of one layer changed in the NPU model."""
    from mcore_npu.integrations.hf import export_hf_weights

    hf = _hf_checkpoint(family, tmp_path)
    bridge, model = _npu_model(tmp_path)
    with torch.no_grad():
        model.decoder.layers[1].mlp.experts.linear_fc2.weight3.add_(0.05)
    assert (_logits(model) - _logits(hf)).abs().max() > 1e-3
    saved = safetensors_torch.load_file(str(next(tmp_path.glob("*.safetensors"))))
    changed = {name for name, tensor in export_hf_weights(model, bridge)
               if not torch.equal(tensor, saved[name])}  # fmt: skip
    down = {"qwen3_moe": "mlp.experts.3.down_proj", "mixtral": "block_sparse_moe.experts.3.w2"}
    assert changed == {f"model.layers.1.{down[family]}.weight"}


@pytest.mark.parametrize("family", ["qwen3_moe_unnormalised", "mixtral"])
def test_mbridge_routing_form_alone_would_not_match(tmp_path, family):
    """Without ``match_hf_routing`` (mbridge's own ``moe_router_pre_softmax``) the logits differ:
    the router's form is what makes these families match."""
    hf = _hf_checkpoint(family, tmp_path)
    bridge, model = _npu_model(tmp_path)
    torch.testing.assert_close(_logits(model), _logits(hf), rtol=0, atol=1e-4)
    mbridge_form = {"qwen3_moe_unnormalised": False, "mixtral": True}[family]
    assert bridge.config.moe_router_pre_softmax is not mbridge_form
    bridge.set_extra_args(moe_router_pre_softmax=mbridge_form)
    plain = build_and_load(bridge, tmp_path)
    assert (_logits(plain) - _logits(hf)).abs().max() > 1e-3
