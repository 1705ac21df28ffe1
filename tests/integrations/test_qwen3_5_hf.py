"""Tiny Qwen3.5 (dense, MoE) and Qwen3-Next through the plugin's
Hugging Face bridge (``mcore_npu.integrations.hf_qwen3_5``) into the NPU spec, against
transformers 5.10.4's own models.

The checkpoints are tests/integrations/qwen3_5_models.py's: 4 layers, 3 Gated DeltaNet + 1
full attention, partial RoPE, gated attention, GVA with K != V, MoE with a gated shared expert,
every norm away from its init. fp32, reference kernels, one process (the CPU runtime of
tests/integrations/conftest.py).

Checked: logits within 1e-4 of transformers for 7, 12 and 70 tokens; the same sequences packed
into one thd batch give each one's logits; export is bit-exact (per-expert and fused expert
checkpoints); neither fla nor transformer_engine is imported.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

import safetensors.torch

from tests.integrations.conftest import VOCAB
from tests.integrations.qwen3_5_models import save_tiny

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("cpu_runtime")]

TOLERANCE = 1e-4
LENGTHS = (7, 12, 70)
CPU_ARGS = dict(use_cpu_initialization=True, masked_softmax_fusion=False,
                bias_activation_fusion=False, bias_dropout_fusion=False,
                gradient_accumulation_fusion=False, variable_seq_lengths=False)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (path, transformers model) of each tiny checkpoint (qwen3_5_models.py)."""
    made = {}
    for kind in ("dense", "moe", "next"):  # the hub form: tests/vision_hf/test_qwen3_5_hub.py
        path = tmp_path_factory.mktemp(f"tiny_qwen3_5_{kind}")
        made[kind] = (str(path), save_tiny(path, kind))
    return made


def _npu(path):
    """``(bridge, model)``: the plugin's bridge (fp32, reference kernels), weights loaded."""
    from mcore_npu.integrations.hf import build_model, load_hf_weights, npu_bridge

    bridge = npu_bridge(path, kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**CPU_ARGS)
    model = build_model(bridge).eval()
    load_hf_weights(model, path, bridge=bridge)
    return bridge, model


@pytest.fixture(scope="module")
def npu_models(checkpoints):
    return {name: _npu(path) for name, (path, _) in checkpoints.items()}


def _sequences():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0]


def _npu_logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids[None], torch.arange(len(ids))[None], None, **kwargs)[0]


def _saved(path) -> dict:
    return safetensors.torch.load_file(str(next(Path(path).glob("*.safetensors"))))


@pytest.mark.parametrize("name", ["dense", "moe", "next"])
def test_logits_match_transformers_and_export_is_bit_exact(name, checkpoints, npu_models):
    from mcore_npu.integrations.hf import export_hf_weights
    from mcore_npu.transformer.gated_delta_net import NPUGatedDeltaNet
    from mcore_npu.transformer.self_attention import NPUSelfAttention

    path, hf_model = checkpoints[name]
    bridge, model = npu_models[name]
    kinds = [type(layer.self_attention) for layer in model.decoder.layers]
    assert kinds[:3] == [NPUGatedDeltaNet] * 3 and issubclass(kinds[3], NPUSelfAttention)
    errors = []
    for ids in _sequences():
        errors.append(float((_npu_logits(model, ids) - _hf_logits(hf_model, ids)).abs().max()))
    print(f"tiny {name}: max |logit - transformers| for {LENGTHS} tokens: {errors}")
    assert max(errors) <= TOLERANCE, errors
    saved, exported = _saved(path), dict(export_hf_weights(model, bridge))
    assert exported.keys() == saved.keys()
    for key, tensor in saved.items():
        assert torch.equal(exported[key], tensor), key


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_packed_thd_gives_each_sequences_logits(name, checkpoints, npu_models):
    from megatron.core.packed_seq_params import PackedSeqParams

    _, hf_model = checkpoints[name]
    _, model = npu_models[name]
    sequences = _sequences()
    ends = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=ends, cu_seqlens_kv=ends,
                             max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))  # fmt: skip
    ids = torch.cat(sequences)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    with torch.no_grad():
        packed = model(ids[None], positions[None], None, packed_seq_params=params)[0]
    errors = [float((packed[a:b] - _hf_logits(hf_model, seq)).abs().max())
              for seq, a, b in zip(sequences, ends[:-1], ends[1:], strict=True)]  # fmt: skip
    print(f"tiny {name}, packed thd: max |logit - transformers| per sequence: {errors}")
    assert max(errors) <= TOLERANCE, errors


def test_the_norms_and_the_gate_each_move_the_logits(checkpoints, npu_models):
    """The comparisons can fail: the GDN output norm taken as zero-centred (``w - 1``), or the
    attention gate's rows zeroed (every gate 1/2), moves the logits far beyond the tolerance."""
    _, hf_model = checkpoints["moe"]
    _, model = npu_models["moe"]
    ids = _sequences()[1]
    want = _hf_logits(hf_model, ids)
    out_norm = model.decoder.layers[0].self_attention.out_norm.weight
    qkv = model.decoder.layers[3].self_attention.linear_qkv.weight  # per group [q q g g k v]
    saved = (out_norm.detach().clone(), qkv.detach().clone())
    try:
        with torch.no_grad():
            out_norm.sub_(1)
        wrong_norm = float((_npu_logits(model, ids) - want).abs().max())
        with torch.no_grad():
            out_norm.copy_(saved[0])
            for group in range(2):  # rows of the two gate heads of each group of 6 heads
                start = (6 * group + 2) * 16
                qkv[start : start + 32] = 0.0
        no_gate = float((_npu_logits(model, ids) - want).abs().max())
    finally:
        with torch.no_grad():
            out_norm.copy_(saved[0])
            qkv.copy_(saved[1])
    print(f"out_norm as zero-centred: {wrong_norm:.1e}; gate rows zeroed: {no_gate:.1e}")
    assert wrong_norm > 1e-2 and no_gate > 1e-2
    assert float((_npu_logits(model, ids) - want).abs().max()) <= TOLERANCE


def test_fused_expert_checkpoints_load_and_export_fused(checkpoints, tmp_path):
    """A checkpoint with the experts as transformers holds them in memory (``gate_up_proj``
    ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) loads to the same logits, and exports fused."""
    from mcore_npu.integrations.hf import export_hf_weights

    path, hf_model = checkpoints["moe"]
    fused = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    safetensors.torch.save_file(fused, str(tmp_path / "model.safetensors"))
    hf_model.config.save_pretrained(tmp_path)
    bridge, model = _npu(str(tmp_path))
    assert bridge.fused_experts
    ids = _sequences()[1]
    assert float((_npu_logits(model, ids) - _hf_logits(hf_model, ids)).abs().max()) <= TOLERANCE
    exported = dict(export_hf_weights(model, bridge))
    assert exported.keys() == fused.keys()
    for key, tensor in fused.items():
        assert torch.equal(exported[key], tensor), key


def test_neither_fla_nor_transformer_engine_is_imported(npu_models):
    assert npu_models  # every model above was built, loaded and run
    imported = sorted(m for m in sys.modules if m.split(".")[0] in ("fla", "transformer_engine"))
    assert imported == []


def test_tensor_parallel_split_and_merge_are_inverse(npu_models):
    """``in_proj`` and ``conv1d`` hold their sections per TP rank: splitting the whole tensor for
    TP = 2 and merging the two ranks' parts gives it back, and each rank gets its heads."""
    import types

    bridge, model = npu_models["dense"]
    attention = model.decoder.layers[0].self_attention
    for name, param in (("decoder.layers.0.self_attention.in_proj.weight", attention.in_proj.weight),
                        ("decoder.layers.0.self_attention.conv1d.weight", attention.conv1d.weight)):  # fmt: skip
        whole = torch.arange(param.shape[0], dtype=torch.float32).view(-1, *[1] * (param.dim() - 1))
        whole = whole.expand(param.shape).contiguous()
        parts = bridge._weight_split_across_tp(name, whole, param[: param.shape[0] // 2], 2)
        q = bridge._gdn_sections[0]
        assert parts[0][0].flatten()[0] == 0 and parts[1][0].flatten()[0] == q // 2  # q heads
        tp2 = types.SimpleNamespace(tp_size=2)
        mpu, bridge.mpu = bridge.mpu, tp2
        try:
            merged = bridge._weight_merge_across_tp(name, list(parts), param)
        finally:
            bridge.mpu = mpu
        assert torch.equal(merged, whole)


def test_the_config_follows_the_checkpoint_and_refuses_what_megatron_cannot_build():
    """Qwen3-Next's dense layers (``mlp_only_layers``) become Megatron's ``moe_layer_freq``;
    ``layer_types`` the GDN pattern; a RoPE type or attention bias Megatron's layers cannot
    reproduce is refused naming the key."""
    import transformers

    from mcore_npu.integrations.hf_qwen3_5 import config_keywords, rope_keywords
    from tests.integrations.qwen3_5_models import MOE, TEXT

    nxt = transformers.Qwen3NextConfig(**TEXT, **MOE, intermediate_size=96, mlp_only_layers=[0])
    keywords = config_keywords(nxt)
    assert keywords["moe_layer_freq"] == [0, 1, 1, 1]
    assert keywords["linear_attention_freq"] == [1, 1, 1, 0]
    assert keywords["moe_router_pre_softmax"] is False  # norm_topk_prob: renormalised top-k
    assert rope_keywords(nxt) == {"rotary_base": 10000.0, "rotary_percent": 0.25}
    biased = transformers.Qwen3_5TextConfig(**{**TEXT, "attention_bias": True})
    with pytest.raises(ValueError, match="attention_bias"):
        config_keywords(biased)
    rope = {**TEXT["rope_parameters"], "rope_type": "linear", "factor": 2.0}
    scaled = transformers.Qwen3_5TextConfig(**{**TEXT, "rope_parameters": rope})
    with pytest.raises(ValueError, match="rope_type"):
        rope_keywords(scaled)
