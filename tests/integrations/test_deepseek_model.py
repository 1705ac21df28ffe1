"""The tiny DeepSeek-V3 model end to end: Hugging Face weights through the plugin's deepseek_v3
bridge into the NPU spec (TE layout), against transformers' ``DeepseekV3ForCausalLM``; then the
same checkpoint through verl's ``TrainingWorker`` with the plugin's engine.

The checkpoint is ``tiny_deepseek_v3_model`` (tests/integrations/conftest.py): MLA with
q_lora_rank (q/k head dim 16 + 8 > value head dim 16), 2 layers of which the first is dense, 8
routed experts in 2 groups with a sigmoid router, a drawn expert bias
(``e_score_correction_bias``), group-limited top-2 (1 group), top-k scaling 2.5, one shared
expert, yarn RoPE (factor 4 over 32 positions). transformers rotates DeepSeek-V3's rope slice
interleaved (``rope_interleave``: pairs regrouped as even channels, then odd, then rotated by
halves), which is what Megatron's MLA RoPE does with ``multi_latent_attention`` (even channels,
then odd), so no RoPE setting is needed.

What the bridge needs on this stack (``mcore_npu.integrations.mbridge_fixes``): the config
keywords, and reading the weights: mbridge's own deepseek_v3 reader refuses every dtype but bf16
and for bf16 imports triton and opens the files on CUDA. Precision as in test_engine_moe.py:
the bridge test loads in fp32; verl's engine loads in bf16, the built GPTModel is then cast to
fp32 and transformers gets the same bf16-rounded weights in fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("verl")

import safetensors.torch
import transformers

from tests.integrations.conftest import VOCAB
from tests.integrations.log_probs import hf_log_probs, mean_negative_log_prob, packed_batch

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("cpu_runtime")]

CPU_ARGS = dict(use_cpu_initialization=True, masked_softmax_fusion=False,
                bias_activation_fusion=False, bias_dropout_fusion=False,
                gradient_accumulation_fusion=False, variable_seq_lengths=False)  # fmt: skip
# verl's Moonlight recipe (tests/special_npu/nightly_ci_ascend/run_grpo_moonlight_16b_megatron_r3
# _npu.sh, verl-project/verl): its override_transformer_config keys for one process (the stage
# sizes and parallel sizes left out), plus one CPU setting: Megatron's fused bias-dropout-add
# (mbridge sets bias_dropout_fusion) is torch.compile'd, ~10 s for the first call on this CPU.
RECIPE = {"multi_latent_attention": True, "use_flash_attn": True, "attention_backend": "fused",
          "recompute_method": "uniform", "recompute_granularity": "full",
          "recompute_num_layers": 1}  # fmt: skip
CPU_OVERRIDE = {"bias_dropout_fusion": False}
LENGTHS = (12, 7, 5)


@pytest.fixture(scope="module", autouse=True)
def _transformer_engine_attention_variables():
    """mbridge's DeepSeek-V3 config says ``attention_backend=fused``, and Megatron's GPTModel
    then sets TE's ``NVTE_FLASH_ATTN=0`` / ``NVTE_FUSED_ATTN=1`` / ``NVTE_UNFUSED_ATTN=0`` in
    the process environment (``LanguageModule._set_attention_backend``), where a later model
    with the default ``auto`` backend fails Megatron's check, as this module's models fail it
    after one with ``auto`` (any earlier test module of the process). Unset for this module,
    put back after it."""
    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    before = {name: os.environ.pop(name, None) for name in names}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="module")
def hf_model(tiny_deepseek_v3_model):
    return transformers.DeepseekV3ForCausalLM.from_pretrained(tiny_deepseek_v3_model).eval()


@pytest.fixture(scope="module")
def npu_model(tiny_deepseek_v3_model, cpu_runtime):
    """``(bridge, GPTModel)``: the plugin's bridge (fp32, reference kernels), weights loaded."""
    from mcore_npu.integrations.hf import build_model, load_hf_weights, npu_bridge

    bridge = npu_bridge(tiny_deepseek_v3_model, kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**CPU_ARGS)
    model = build_model(bridge).eval()
    load_hf_weights(model, tiny_deepseek_v3_model, bridge=bridge)
    return bridge, model


def _logits(model) -> torch.Tensor:
    """``[2, 24, VOCAB]`` logits of a fixed batch, from a transformers or a Megatron model."""
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if isinstance(model, transformers.PreTrainedModel):
            return model(input_ids=ids).logits
        return model(ids, torch.arange(24).expand(2, 24), None)


def test_the_bridge_builds_the_npu_spec_in_te_layout(npu_model, hf_model):
    from mcore_npu.transformer.mla import NPUMLASelfAttention
    from mcore_npu.transformer.mlp import NPUMLP, NPUSharedExpertMLP
    from mcore_npu.transformer.norm_linear import NormColumnParallelLinear
    from mcore_npu.transformer.router import NPUTopKRouter

    _, model = npu_model
    dense, moe = model.decoder.layers
    for layer in (dense, moe):
        attention = layer.self_attention
        assert type(attention) is NPUMLASelfAttention
        assert type(attention.core_attention).__name__ == "TELayoutNPUFusionAttention"
        assert isinstance(attention.linear_q_up_proj, NormColumnParallelLinear)  # latent norms
        assert isinstance(attention.linear_kv_up_proj, NormColumnParallelLinear)
    assert type(dense.mlp) is NPUMLP
    assert type(moe.mlp.router) is NPUTopKRouter
    assert type(moe.mlp.experts).__name__ == "NPUGroupedMLP"
    assert type(moe.mlp.shared_experts) is NPUSharedExpertMLP
    assert model.config.moe_shared_expert_overlap  # mbridge's setting: the overlapped path
    bias = hf_model.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(moe.mlp.router.expert_bias, bias)


def test_logits_match_transformers_and_export_is_bit_exact(npu_model, hf_model,
                                                           tiny_deepseek_v3_model):  # fmt: skip
    bridge, model = npu_model
    want, got = _logits(hf_model), _logits(model)
    error = float((got - want).abs().max())
    print(f"tiny DeepSeek-V3: max |logit - transformers| = {error:.1e}")
    assert error <= 1e-4, error
    _assert_exports_the_checkpoint(model, bridge, tiny_deepseek_v3_model)


def test_the_latent_norms_keep_transformers_epsilon_when_rms_norm_eps_differs(tmp_path):
    """Moonlight's ``rms_norm_eps`` is 1e-5, while transformers (and DeepSeek's remote code)
    build the q / kv latent RMSNorms at 1e-6 whatever it says: through the plugin's bridge the
    latent norms (inside the up projections) take 1e-6, the other norms 1e-5, and the logits
    match transformers within 1e-5; at ``rms_norm_eps`` throughout they move further."""
    from mcore_npu.integrations.hf import build_model, load_hf_weights, npu_bridge
    from tests.integrations.conftest import save_tiny_deepseek_v3

    hf_model = save_tiny_deepseek_v3(tmp_path, rms_norm_eps=1e-5)
    bridge = npu_bridge(str(tmp_path), kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**CPU_ARGS)
    model = build_model(bridge).eval()
    load_hf_weights(model, str(tmp_path), bridge=bridge)
    ups = [getattr(layer.self_attention, name) for layer in model.decoder.layers
           for name in ("linear_q_up_proj", "linear_kv_up_proj")]  # fmt: skip
    assert {up.eps for up in ups} == {1e-6}
    assert {layer.input_layernorm.eps for layer in model.decoder.layers} == {1e-5}
    want = _logits(hf_model)
    error = float((_logits(model) - want).abs().max())
    for up in ups:
        up.eps = 1e-5
    off = float((_logits(model) - want).abs().max())
    print(f"tiny DeepSeek-V3, rms_norm_eps 1e-5: max |logit - transformers| = {error:.1e} "
          f"(latent norms at 1e-5: {off:.1e})")  # fmt: skip
    assert error <= 1e-5 and off > 3 * error, (error, off)


def _assert_exports_the_checkpoint(model, bridge, path: str) -> None:
    """The bridge exports ``model`` as exactly the checkpoint's tensors, names and values."""
    from pathlib import Path

    from mcore_npu.integrations.hf import export_hf_weights

    saved = safetensors.torch.load_file(str(next(Path(path).glob("*.safetensors"))))
    exported = dict(export_hf_weights(model, bridge))
    assert exported.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(exported[name].cpu(), tensor), name


def test_the_expert_bias_and_the_yarn_scale_each_move_the_logits(npu_model, hf_model):
    """The comparison above can fail: without the drawn expert bias the experts chosen change,
    and without yarn's concentration factor the attention's softmax scale changes."""
    _, model = npu_model
    want = _logits(hf_model)
    router = model.decoder.layers[1].mlp.router
    attentions = [layer.self_attention for layer in model.decoder.layers]
    bias, scales = router.expert_bias.clone(), [a.core_attention.softmax_scale for a in attentions]
    try:
        router.expert_bias.zero_()
        no_bias = float((_logits(model) - want).abs().max())
        router.expert_bias.copy_(bias)
        for attention in attentions:
            attention.core_attention.softmax_scale = attention.q_head_dim**-0.5
        no_yarn_scale = float((_logits(model) - want).abs().max())
    finally:
        router.expert_bias.copy_(bias)
        for attention, scale in zip(attentions, scales, strict=True):
            attention.core_attention.softmax_scale = scale
    print(f"without the expert bias {no_bias:.1e}, without yarn's scale {no_yarn_scale:.1e}")
    assert no_bias > 1e-3 and no_yarn_scale > 1e-3
    assert float((_logits(model) - want).abs().max()) <= 1e-4


def test_mbridges_own_reader_cannot_load_this_checkpoint(npu_model, tiny_deepseek_v3_model):
    """Why the plugin's bridge reads the weights itself: mbridge 0.15.1's deepseek_v3 reader."""
    from mbridge.core.safetensor_io import SafeTensorIO
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    bridge, _ = npu_model
    with pytest.raises(TypeError):  # fp32: `raise NotImplemented(...)`
        DeepseekV3Bridge._get_safetensor_io(bridge, tiny_deepseek_v3_model)
    assert type(bridge._get_safetensor_io(tiny_deepseek_v3_model)) is SafeTensorIO


def test_verls_training_worker_with_the_plugins_engine_matches_transformers(
    tiny_deepseek_v3_model,
):
    """verl's ``TrainingWorker`` picks the plugin's engine, builds the model through the
    plugin's bridge with the Moonlight recipe's keys; one forward and backward of verl's
    ``forward_backward_batch`` (thd): log-probs within 1e-4 of transformers', every gradient
    finite, most non-zero."""
    from verl.workers.engine_workers import TrainingWorker

    from mcore_npu.integrations.verl.engine import NPUMegatronEngineWithLMHead
    from mcore_npu.transformer.mla import NPUMLASelfAttention
    from tests.integrations.conftest import training_worker_config
    from tests.integrations.test_recipes import _grad

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VERL_ENGINE_DEVICE", "npu")
        env.setenv("VERL_ENGINE_VENDOR", "huawei")
        config = training_worker_config(tiny_deepseek_v3_model, remove_padding=True,
                                        override_transformer_config={**RECIPE, **CPU_OVERRIDE})  # fmt: skip
        engine = TrainingWorker(config).engine
    assert type(engine) is NPUMegatronEngineWithLMHead
    engine._build_tf_config()  # the first two steps of engine.initialize()
    engine.module = engine._build_megatron_module()
    assert engine.tf_config.recompute_granularity == "full"
    gpt = engine.module[0]
    while not hasattr(gpt, "decoder"):
        gpt = gpt.module
    assert {type(layer.self_attention) for layer in gpt.decoder.layers} == {NPUMLASelfAttention}
    gpt.float()  # the bf16-loaded weights, computed in fp32
    data, _ = packed_batch(LENGTHS)
    result = engine.forward_backward_batch(data, mean_negative_log_prob)
    rows = result["model_output"]["log_probs"].unbind()
    got = [row[: n - 1].float() for row, n in zip(rows, LENGTHS, strict=True)]
    want = hf_log_probs(tiny_deepseek_v3_model, LENGTHS, transformers.DeepseekV3ForCausalLM)
    error = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    print(f"tiny DeepSeek-V3 through verl: max |log p - log p_hf| = {error:.1e}")
    assert error < 1e-4, error
    grads = [_grad(p) for p in engine.module[0].parameters()]
    assert all(torch.isfinite(g).all() for g in grads)
    assert sum(bool(g.abs().sum() > 0) for g in grads) > len(grads) // 2


# ---------------------------------------------------------------------------------------------
# sequential experts (moe_grouped_gemm=False, Kimi-K2.5's recipe): the same model as grouped ones
# ---------------------------------------------------------------------------------------------


def _with_spec(bridge, **spec_keywords):
    """A GPTModel from ``bridge``'s provider with the NPU block spec given ``spec_keywords``
    (the bridge's own hook is put back afterwards)."""
    from mcore_npu.integrations.hf import build_model
    from mcore_npu.transformer.layer_specs import get_gpt_decoder_block_npu_spec

    def layer_spec(vp_stage=None):
        return get_gpt_decoder_block_npu_spec(
            bridge.config, kernel="reference", param_layout="te",
            normalization=bridge.config.normalization, vp_stage=vp_stage, **spec_keywords,
        )  # fmt: skip

    hook = bridge._get_transformer_layer_spec
    bridge._get_transformer_layer_spec = layer_spec
    try:
        return build_model(bridge).eval()
    finally:
        bridge._get_transformer_layer_spec = hook


def _through_checkpoint(source, target, folder) -> None:
    """``target`` gets ``source``'s weights through a Megatron distributed checkpoint."""
    from megatron.core import dist_checkpointing

    folder.mkdir()
    dist_checkpointing.save(source.sharded_state_dict(), str(folder))
    target.load_state_dict(dist_checkpointing.load(target.sharded_state_dict(), str(folder)))


SEQUENTIAL = {
    "plugin": {},  # NPUGroupedMLP under SequentialMLP's names (npu_grouped_matmul)
    "megatron": {"grouped_matmul_kernel": "off"},  # Megatron's own SequentialMLP
}


@pytest.mark.parametrize("kind", SEQUENTIAL)
def test_sequential_and_grouped_experts_give_equal_logits_and_export_equal_weights(
    kind, npu_model, tiny_deepseek_v3_model, tmp_path
):
    """``moe_grouped_gemm=False``: the experts under ``SequentialMLP``'s names
    (``local_experts.{e}.linear_fc1.weight``), given the grouped model's weights through
    Megatron's distributed checkpoint (both write SequentialMLP's keys): the logits equal the
    grouped model's (fp32, 1e-5); its checkpoint loaded back into grouped experts exports, through
    the bridge, exactly the checkpoint's Hugging Face tensors."""

    bridge, grouped = npu_model
    sequential = _with_spec(bridge, moe_grouped_gemm=False, **SEQUENTIAL[kind])
    experts = sequential.decoder.layers[1].mlp.experts
    want_class = "NPUGroupedMLP" if kind == "plugin" else "SequentialMLP"
    assert type(experts).__name__ == want_class and len(experts.local_experts) == 8
    assert not torch.equal(_logits(sequential), _logits(grouped))  # not loaded yet: can fail
    _through_checkpoint(grouped, sequential, tmp_path / "from_grouped")
    error = float((_logits(sequential) - _logits(grouped)).abs().max())
    print(f"sequential experts ({kind}) vs grouped: max |logit diff| = {error:.1e}")
    assert error <= 1e-5, error
    back = _with_spec(bridge)  # grouped experts, fresh weights
    _through_checkpoint(sequential, back, tmp_path / "from_sequential")
    _assert_exports_the_checkpoint(back, bridge, tiny_deepseek_v3_model)


def test_mbridge_builds_grouped_experts_for_moe_grouped_gemm_false_with_one_log_line(
    tiny_deepseek_v3_model, npu_model, caplog
):
    """mbridge maps only the grouped experts' names: the Kimi-K2.5 recipe's
    ``moe_grouped_gemm=False`` through the bridge builds grouped experts, says so in one line,
    loads the checkpoint and gives the grouped model's logits exactly."""
    import logging

    from mcore_npu.integrations.hf import build_model, load_hf_weights, npu_bridge

    bridge = npu_bridge(tiny_deepseek_v3_model, kernel="reference", dtype=torch.float32)
    bridge.set_extra_args(**CPU_ARGS, moe_grouped_gemm=False)
    with caplog.at_level(logging.INFO, logger="mcore_npu.integrations.mbridge_fixes"):
        model = build_model(bridge).eval()
    lines = [r.getMessage() for r in caplog.records if "moe_grouped_gemm=False" in r.getMessage()]
    assert len(lines) == 1 and "grouped experts are built instead" in lines[0], lines
    assert bridge.config.moe_grouped_gemm is False  # the config keeps what was asked
    names = [name for name, _ in model.named_parameters() if ".experts." in name]
    assert names and all(".local_experts." not in name for name in names)
    load_hf_weights(model, tiny_deepseek_v3_model, bridge=bridge)
    assert torch.equal(_logits(model), _logits(npu_model[1]))
