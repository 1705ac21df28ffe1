"""Hugging Face weights through mbridge's AutoBridge into the NPU spec (TE layout), on the CPU.

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
FAMILIES = {  # GQA, RoPE, RMSNorm, SwiGLU; qkv bias for Qwen2, q/k norm for Qwen3
    "llama": lambda: transformers.LlamaConfig(**COMMON, hidden_act="silu"),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, hidden_act="silu"),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16, hidden_act="silu"),
}
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
    from mcore_npu.integrations.hf import build_model, load_hf_weights, npu_bridge

    bridge = npu_bridge(str(path), kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**CPU_ARGS)
    model = build_model(bridge).eval()
    load_hf_weights(model, str(path), bridge=bridge)
    return bridge, model


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_and_export_is_bit_exact(tmp_path, family):
    from mcore_npu.integrations.hf import export_hf_weights
    from mcore_npu.transformer.norm_linear import NormColumnParallelLinear

    hf = _hf_checkpoint(family, tmp_path)
    bridge, model = _npu_model(tmp_path)
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, NormColumnParallelLinear)  # TE layout
    assert type(layer.self_attention.core_attention).__name__ == "TELayoutNPUFusionAttention"

    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = model(ids, torch.arange(24).expand(2, 24), None)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)

    saved = safetensors_torch.load_file(str(next(tmp_path.glob("*.safetensors"))))
    exported = dict(export_hf_weights(model, bridge))
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(exported[name].cpu(), tensor), name
