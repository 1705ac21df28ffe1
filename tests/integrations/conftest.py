"""Fixtures for the tests against the real verl 0.9.1 (the ``.venv-verl`` environment).

These tests need ``make test-verl``: verl, mbridge, transformers and the package installed with
``pip install --no-deps -e .`` (so its ``verl.plugins`` entry point exists). ``make test`` does
not collect this folder; every module also starts with ``pytest.importorskip("verl")``.

One process, one gloo group: ``cpu_runtime`` (session, tests/conftest.py, shared with
tests/nemotron and tests/vision_hf) applies the project's CPU shims, starts a single-rank gloo
process group and, after the last test, destroys Megatron's parallel state and the group and
reverts the shims. Nothing in verl is patched. The only stand-in is the NPU allocator (``tests/allocator/standins.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

VOCAB = 128


def _save_word_level_tokenizer(path, size: int = VOCAB) -> None:
    """A tokenizer with tokens ``t0 .. t{size-1}`` (pad = ``t0``): verl's thd path reads
    pad_token_id."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="t0", unk_token="t0", eos_token="t1"
    )
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory) -> str:
    """A 2-layer Qwen2 checkpoint (safetensors, fp32, random weights) and a word-level tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny_qwen2")
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    _save_word_level_tokenizer(path)
    return str(path)


# A DeepSeek-V3-shaped checkpoint, tiny: MLA with q_lora_rank (q/k head dim 16 + 8 = 24 > v 16,
# the ratio of DeepSeek-V3's 192 / 128), 2 layers of which the first dense (first_k_dense_replace),
# then 8 routed experts in 2 groups with a sigmoid router, expert bias (e_score_correction_bias),
# group-limited top-2 (1 group of 2; 2 // 1 = 2 is what Megatron's group score needs), top-k
# scaling 2.5, one shared expert, and yarn RoPE (factor 4 over 32 positions); weights drawn with
# std 0.1 (transformers' default 0.02 leaves the logits near 0 and the attention near uniform,
# where a wrong softmax scale hardly shows).
DEEPSEEK_V3 = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
    max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.1,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                         original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0,
                         mscale=1.0, mscale_all_dim=1.0),
)  # fmt: skip


def tiny_deepseek_v3_config(**overrides):
    """transformers' ``DeepseekV3Config`` of the tiny model, ``overrides`` applied."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**DEEPSEEK_V3, **overrides})


def save_tiny_deepseek_v3(path, **overrides):
    """Save the tiny DeepSeek-V3 (safetensors, fp32, random weights, the word-level tokenizer)
    to ``path``; returns the transformers ``DeepseekV3ForCausalLM`` (eval mode).

    The norms are moved away from 1 and ``e_score_correction_bias`` (a buffer, zero when built)
    drawn from N(0, 0.05^2), so that a dropped norm or expert bias changes the output.
    """
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(tiny_deepseek_v3_config(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.05)
    model.save_pretrained(path, safe_serialization=True)
    _save_word_level_tokenizer(path)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_deepseek_v3_model(tmp_path_factory) -> str:
    """The path of the tiny DeepSeek-V3 checkpoint (:func:`save_tiny_deepseek_v3`)."""
    path = tmp_path_factory.mktemp("tiny_deepseek_v3")
    save_tiny_deepseek_v3(path)
    return str(path)


@pytest.fixture(scope="session")
def qwen3_5_hub(tmp_path_factory) -> str:
    """A tiny hub-form Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``: the text model under
    ``model.language_model.``, a 1-block vision tower, ``vision_config`` in its config), the form
    every Qwen3.5 checkpoint on the hub has, with the word-level tokenizer; its weights
    bf16-exact (stored in fp32), as ``log_probs.hf_log_probs`` computes them."""
    from tests.integrations.qwen3_5_models import save_tiny

    path = tmp_path_factory.mktemp("tiny_qwen3_5_hub")
    save_tiny(path, "hub", bf16_exact=True)
    _save_word_level_tokenizer(path)
    return str(path)


# A Nemotron-H checkpoint, tiny: tests/nemotron/nemotron_models.py's shape (pattern ``M*M-M*``:
# 3 Mamba2 layers of 4 heads of 16, 2 groups, state 16, conv 4 with a bias; 2 attention layers;
# 1 squared-ReLU MLP; hidden 64) with chunk 4, shorter than the test rows; time_step_min 1e-9:
# transformers 5.10.4's pure-torch scan clamps softplus(dt + dt_bias) at it, Megatron does not.
NEMOTRON_H = dict(chunk_size=4, time_step_min=1e-9)


def save_tiny_nemotron_h(path) -> str:
    """Save the tiny Nemotron-H (``NemotronHForCausalLM`` of this environment's transformers,
    5.10.4) to ``path``: weights drawn by ``nemotron_models.draw`` (every norm, ``D`` and
    ``dt_bias`` away from its init), rounded to bf16 (stored in fp32), and the tokenizer."""
    from transformers import NemotronHForCausalLM

    from tests.nemotron.nemotron_models import draw, tiny_config

    torch.manual_seed(0)
    model = NemotronHForCausalLM(tiny_config(**NEMOTRON_H))
    draw(model)
    return save_bf16_exact(model, path)


def engine_model(engine):
    """The Megatron model (GPTModel / MambaModel / NPUQwen3VLModel) inside a verl engine's first
    chunk, its DDP and mixed-precision wrappers taken off."""
    model = engine.module[0]
    while not hasattr(model, "decoder") and not hasattr(model, "language_model"):
        model = model.module
    return model


def lm_head_engine(config, *, build_model: bool = True, **engine_fields):
    """``(engine, the worker's engine config)``: verl's ``TrainingWorker`` for ``config`` (a
    ``TrainingWorkerConfig``; its tokenizer loaded, ``engine_fields`` replacing engine-config
    fields) with the plugin's LM-head engine, as verl's registry picks it for ``("npu",
    "huawei")``; then the first steps of ``engine.initialize()``: the TransformerConfig and,
    with ``build_model``, the model."""
    import dataclasses

    from verl.workers.engine_workers import TrainingWorker

    from mcore_npu.integrations.verl.engine import NPUMegatronEngineWithLMHead
    from tests.integrations.verl_loop import npu_engine

    engine_config = dataclasses.replace(config.engine_config, **engine_fields)
    model_config = dataclasses.replace(config.model_config, load_tokenizer=True)
    config = dataclasses.replace(config, engine_config=engine_config, model_config=model_config)
    with npu_engine():
        worker = TrainingWorker(config)
    engine = worker.engine
    assert type(engine) is NPUMegatronEngineWithLMHead
    engine._build_tf_config()
    if build_model:
        engine.module = engine._build_megatron_module()
    return engine, worker.config.engine_config


def accumulated_grad(param) -> torch.Tensor:
    """``main_grad`` (Megatron's DDP) plus ``param.grad`` (the fp32 cast's own accumulator)."""
    extra = param.grad if param.grad is not None else 0
    return param.main_grad.float() + extra


def save_bf16_exact(model, path) -> str:
    """Save ``model`` to ``path`` with every weight rounded to bf16 (stored in fp32, so an engine
    loading bf16 holds the same numbers) and the word-level tokenizer; returns the path."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    model.save_pretrained(path, safe_serialization=True)
    _save_word_level_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def nemotron_h(tmp_path_factory) -> str:
    """The path of the tiny Nemotron-H checkpoint (:func:`save_tiny_nemotron_h`)."""
    return save_tiny_nemotron_h(tmp_path_factory.mktemp("tiny_nemotron_h"))


def training_worker_config(
    model_path: str, *, remove_padding: bool = False, override_transformer_config=None
):
    """verl's ``TrainingWorkerConfig`` for the tiny model: Megatron + vanilla mbridge, bf16.

    ``override_transformer_config``: verl's user-facing overrides of the TransformerConfig.

    bf16 because verl's ``McoreEngineConfig`` accepts only bfloat16 / float16
    (``verl/workers/config/engine.py``, ``__post_init__``).
    """
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import (
        HFModelConfig,
        McoreEngineConfig,
        McoreOptimizerConfig,
        TrainingWorkerConfig,
    )

    return TrainingWorkerConfig(
        model_type="language_model",
        model_config=HFModelConfig(
            path=model_path, load_tokenizer=remove_padding, use_remove_padding=remove_padding
        ),
        engine_config=McoreEngineConfig(
            strategy="megatron",
            dtype="bfloat16",
            use_mbridge=True,
            vanilla_mbridge=True,
            override_transformer_config=dict(override_transformer_config or {}),
        ),
        optimizer_config=McoreOptimizerConfig(lr=1e-3),
        checkpoint_config=CheckpointConfig(),
    )


@pytest.fixture
def npu_engine_env(monkeypatch):
    """Make verl's EngineRegistry look up ``("npu", "huawei")``, as on an Ascend machine."""
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "npu")
    monkeypatch.setenv("VERL_ENGINE_VENDOR", "huawei")


# ---------------------------------------------------------------------------------------------
# verl's training loop (test_loop.py, test_loop_parallel.py): checkpoints and one-process runs
# ---------------------------------------------------------------------------------------------

SFT_STEPS = 30  # the dense SFT run; its first steps are also the one-process reference
MOE_STEPS = 5


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory) -> str:
    """A tiny Qwen3 (hidden 64, 2 layers, vocab 128, random weights) and its tokenizer."""
    from tests.integrations import verl_loop

    return verl_loop.save_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def qwen3_moe(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE (4 experts, top-2) and its tokenizer."""
    from tests.integrations import verl_loop

    return verl_loop.save_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


NVTE = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@pytest.fixture
def own_attention_variables():
    """mbridge's DeepSeek-V3 config says ``attention_backend=fused`` and the others ``auto``;
    Megatron's GPTModel writes TE's ``NVTE_*`` variables from it and asserts one setting per
    process (a real run builds one family per process; a test module may build several): the
    test starts without them and they are put back after it."""
    before = {name: os.environ.pop(name, None) for name in NVTE}
    yield
    for name, value in before.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


@pytest.fixture(scope="session")
def qwen3_vl(tmp_path_factory) -> str:
    """A tiny dense Qwen3-VL with its vision tower and tokenizer (tests/integrations/qwen3_vl_data.py)."""
    from tests.integrations import qwen3_vl_data

    return qwen3_vl_data.save_checkpoint(tmp_path_factory.mktemp("qwen3_vl"))


@pytest.fixture(scope="session")
def qwen3_vl_moe(tmp_path_factory) -> str:
    """A tiny Qwen3-VL-MoE with its vision tower and tokenizer (tests/integrations/qwen3_vl_data.py)."""
    from tests.integrations import qwen3_vl_data

    return qwen3_vl_data.save_checkpoint(tmp_path_factory.mktemp("qwen3_vl_moe"), moe=True)


@pytest.fixture(scope="session")
def mimo(tmp_path_factory) -> str:
    """A tiny MiMo (Qwen2's shape, one MTP layer; remote-code config) and its tokenizer."""
    from tests.integrations import verl_loop

    return verl_loop.save_mimo_checkpoint(tmp_path_factory.mktemp("mimo"))


@pytest.fixture(scope="session")
def dense_sft_run(cpu_runtime, qwen3):
    """``(worker, metrics)``: 30 ``train_batch`` steps of verl's SFT loss on the tiny Qwen3, thd,
    one process, with ``verl_loop.FAMILY_SETTINGS["qwen3"]``."""
    from tests.integrations import verl_loop

    settings = verl_loop.FAMILY_SETTINGS["qwen3"]
    worker = verl_loop.new_worker(verl_loop.worker_config(qwen3, **settings),
                                  verl_loop.sft_loss_fn())  # fmt: skip
    return worker, verl_loop.train_sft(worker, SFT_STEPS)


@pytest.fixture(scope="session")
def moe_sft_run(cpu_runtime, qwen3_moe):
    """``(worker, metrics)``: 5 SFT steps on the tiny Qwen3-MoE, thd, one process."""
    from tests.integrations import verl_loop

    settings = verl_loop.FAMILY_SETTINGS["qwen3_moe"]
    worker = verl_loop.new_worker(verl_loop.worker_config(qwen3_moe, **settings),
                                  verl_loop.sft_loss_fn())  # fmt: skip
    return worker, verl_loop.train_sft(worker, MOE_STEPS)
