"""Qwen3.5 (a Gated DeltaNet hybrid MoE) through verl 0.9.1's ``TrainingWorker`` and the plugin's
engine, with the key sets of the five public Ascend recipes that train it, verbatim
(``tests/integrations/gdn_recipes.yaml``: three distinct key sets).

- A tiny ``qwen3_5_moe_text`` checkpoint (transformers 5.10.4): 3 GDN layers (2 key heads, 4
  value heads, K = V = 128: the head size the Ascend kernels take) + 1 full-attention layer
  (partial RoPE, gated attention output, zero-centred norms), 4 experts top-2 with the shared
  expert and its gate; weights drawn as ``qwen3_5_models.draw`` draws them (norms away from
  their inits) and rounded to bf16 before saving (the engine loads bf16: both sides hold the
  same numbers).
- verl's ``TrainingWorker`` picks the plugin's engine (``VERL_ENGINE_DEVICE=npu``,
  ``VERL_ENGINE_VENDOR=huawei``); the recipe's ``override_transformer_config`` goes in unchanged.
  The model comes from the plugin's Hugging Face path (mbridge has no Qwen3.5 bridge; the
  recipes' ``vanilla_mbridge=False`` falls back to it: ``weight_path.py``).
- One forward and backward through verl's ``forward_backward_batch`` on the model cast to fp32
  (bf16 weights computed in fp32): log-probs within 1e-3 of transformers' (the same weights, fp32),
  in bshd as the recipes run it, thd (``use_remove_padding=True``) and thd with
  ``use_dynamic_bsz`` (a 16-token budget: the 24 tokens run as several micro-batches);
  every parameter of every GDN layer gets a finite, non-zero gradient.
- The Ascend kernels' stand-ins (no NPU here; ``tests/gated_delta_standin.py``, in
  ``sys.modules``): verl's forward-only log-prob pass calls torch_npu's forward-only
  ``npu_chunk_gated_delta_rule`` once per GDN layer in the documented TND layout; a training
  step with the nightly recipe's full recompute runs fla_npu's documented forward chain twice
  (forward, recompute) and its backward chain once per GDN layer, in order. Both give the reference kernel's log-probs within the bf16 model's own
  round-off (its distance to the same weights computed in fp32).
- ``use_naive_l2norm=True`` reaches the GDN layers (``NPUGatedDeltaNet.naive_l2norm``); on a
  model without GDN layers (the tiny DeepSeek-V3, the architecture of Kimi-K2.5 whose recipe sets
  it) it is accepted with one log line and no effect.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

import transformers
import yaml

from mcore_npu.transformer.gated_delta_net import NPUGatedDeltaNet
from tests.gated_delta_standin import install_fla_npu, install_torch_npu
from tests.integrations.conftest import (
    VOCAB,
    accumulated_grad,
    engine_model,
    lm_head_engine,
    save_bf16_exact,
    training_worker_config,
)
from tests.integrations.log_probs import hf_log_probs, mean_negative_log_prob, packed_batch
from tests.integrations.qwen3_5_models import IMAGE_IDS, VISION, draw

pytestmark = pytest.mark.usefixtures("cpu_runtime")

RECIPES = yaml.safe_load((Path(__file__).parent / "gdn_recipes.yaml").read_text())["recipes"]
# every recipe in each layout it runs, on the hub form the recipes train; thd without dynamic
# batch once; the text form (Qwen3_5MoeForCausalLM) in bshd and thd once
CASES = [(recipe["name"], layout, "hub") for recipe in RECIPES for layout in recipe["layouts"]]
CASES += [(RECIPES[0]["name"], "thd", "hub"), (RECIPES[0]["name"], "bshd", "text"),
          (RECIPES[0]["name"], "thd", "text")]  # fmt: skip
BY_NAME = {recipe["name"]: recipe for recipe in RECIPES}
LENGTHS = (12, 7, 5)
TOKEN_BUDGET = 16  # max_token_len_per_gpu of the dynamic-batch case: 24 tokens, > 1 micro-batch
TOLERANCE = 1e-3

# layer_types: transformers' default, 3 linear_attention + 1 full_attention
QWEN3_5_MOE = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
    tie_word_embeddings=False,
)  # fmt: skip


def save_tiny_qwen3_5_moe(path, *, hub: bool = False) -> str:
    """The tiny Qwen3.5 MoE checkpoint in ``path``: the text model (``Qwen3_5MoeForCausalLM``)
    or, with ``hub``, the form hub checkpoints have (``Qwen3_5MoeForConditionalGeneration``: the
    same text model under ``model.language_model.``, a 2-block vision tower, ``vision_config``);
    weights drawn as ``tests/integrations/qwen3_5_models.draw`` draws them (every norm away from
    its init), then rounded to bf16 (stored in fp32), and the word-level tokenizer."""
    torch.manual_seed(0)
    if hub:
        config = transformers.Qwen3_5MoeConfig(text_config=QWEN3_5_MOE, vision_config=VISION,
                                               **IMAGE_IDS)  # fmt: skip
        model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    else:
        config = transformers.Qwen3_5MoeTextConfig(**QWEN3_5_MOE)
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert config.get_text_config().layer_types.count("linear_attention") == 3
    draw(model)
    return save_bf16_exact(model, path)


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory) -> str:
    return save_tiny_qwen3_5_moe(tmp_path_factory.mktemp("tiny_qwen3_5_moe"))


@pytest.fixture(scope="module")
def qwen3_5_moe_hub(tmp_path_factory) -> str:
    return save_tiny_qwen3_5_moe(tmp_path_factory.mktemp("tiny_qwen3_5_moe_hub"), hub=True)


@pytest.fixture(scope="module")
def checkpoints(qwen3_5_moe, qwen3_5_moe_hub) -> dict:
    """form -> (path, transformers' log-probs of the :func:`packed_batch` rows, fp32)."""
    hub_class = transformers.Qwen3_5MoeForConditionalGeneration
    return {
        "text": (qwen3_5_moe, hf_log_probs(qwen3_5_moe, LENGTHS)),
        "hub": (qwen3_5_moe_hub, hf_log_probs(qwen3_5_moe_hub, LENGTHS, hub_class)),
    }


def _engine(path: str, keys: dict, *, thd: bool, **engine_fields):
    """``(engine after _build_tf_config, the worker's own engine config)``, with the recipes'
    ``vanilla_mbridge=False`` (Megatron-Bridge does not import here: the mbridge fallback) and
    ``engine_fields`` (more ``McoreEngineConfig`` fields)."""
    config = training_worker_config(path, remove_padding=thd, override_transformer_config=keys)
    fields = {"vanilla_mbridge": False, **engine_fields}
    return lm_head_engine(config, build_model=False, **fields)


@pytest.mark.parametrize(("name", "layout", "form"), CASES)
def test_qwen3_5_recipe_matches_transformers_with_finite_gdn_gradients(
    name, layout, form, checkpoints
):
    keys = BY_NAME[name]["keys"]
    path, hf_reference = checkpoints[form]
    engine, worker_engine_config = _engine(path, keys, thd=layout != "bshd")
    before = copy.deepcopy(dict(worker_engine_config.override_transformer_config))
    engine.module = engine._build_megatron_module()
    assert before == keys  # the worker's config still holds the recipe as written
    assert engine.mbridge_fallback and not worker_engine_config.vanilla_mbridge
    assert engine.npu_spec_keywords["gdn_naive_l2norm"] is True
    gdn = [m for m in engine_model(engine).modules() if isinstance(m, NPUGatedDeltaNet)]
    assert len(gdn) == 3 and all(m.naive_l2norm for m in gdn)
    for key in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        assert getattr(engine.tf_config, key) == keys[key]
    engine_model(engine).float()  # the bf16-loaded weights, computed in fp32

    data, _ = packed_batch(LENGTHS)
    if layout == "thd_dynamic":
        data = _dynamic(data)
    micro_batches = _count_micro_batches(engine)
    result = engine.forward_backward_batch(data, mean_negative_log_prob)
    if layout == "thd_dynamic":  # the token budget split the 24 tokens
        assert len(micro_batches) > 1 and max(micro_batches) <= TOKEN_BUDGET, micro_batches
        assert sum(micro_batches) == sum(LENGTHS)
    else:
        assert micro_batches == [sum(LENGTHS)]
    rows = result["model_output"]["log_probs"].unbind()
    got = [row[: n - 1].float() for row, n in zip(rows, LENGTHS, strict=True)]
    error = max(float((g - w).abs().max()) for g, w in zip(got, hf_reference, strict=True))
    print(f"{name} ({layout}, {form}): max |log p - log p_hf| = {error:.2e}")
    assert error < TOLERANCE, f"{name} ({layout}, {form}): max |log p - log p_hf| = {error:.2e}"
    for layer in gdn:
        for pname, param in layer.named_parameters():
            grad = accumulated_grad(param)
            assert torch.isfinite(grad).all(), pname
            assert grad.abs().sum() > 0, f"{pname}: zero gradient"


def _count_micro_batches(engine) -> list[int]:
    """The token count of every micro-batch the engine runs from now on (a spy on this engine
    instance's ``forward_step`` that calls through)."""
    tokens, forward = [], engine.forward_step

    def counting_forward(batch_iter, *args, **kwargs):
        micro = next(batch_iter)
        tokens.append(int(micro["input_ids"].offsets()[-1]))
        return forward(iter([micro]), *args, **kwargs)

    engine.forward_step = counting_forward
    return tokens


def _dynamic(data):
    """The same batch with verl's dynamic batch size: a token budget instead of a row count."""
    from verl.utils import tensordict_utils as tu

    tensors = {key: data[key] for key in ("input_ids", "loss_mask", "temperature")}
    return tu.get_tensordict(
        tensors, {"use_dynamic_bsz": True, "max_token_len_per_gpu": TOKEN_BUDGET}
    )


def test_use_naive_l2norm_on_a_model_without_gdn_layers_is_one_log_line(
    tiny_deepseek_v3_model, caplog
):
    """Kimi-K2.5's recipe sets ``use_naive_l2norm=True`` on an MLA model (no GDN layers):
    accepted, nothing reaches Megatron or the spec, one log line says it has no effect."""
    with caplog.at_level(logging.INFO, logger="mcore_npu.integrations.verl.recipe"):
        engine, _ = _engine(tiny_deepseek_v3_model, {"use_naive_l2norm": True}, thd=True)
    lines = [r.getMessage() for r in caplog.records if "use_naive_l2norm" in r.getMessage()]
    assert len(lines) == 1 and "no effect" in lines[0], lines
    assert "gdn_naive_l2norm" not in engine.npu_spec_keywords
    assert "use_naive_l2norm" not in engine.engine_config.override_transformer_config


def _forward_only_log_probs(engine, data, lengths=LENGTHS) -> list[torch.Tensor]:
    """verl's forward-only pass (its log-prob computation: no gradients), one row per sample."""
    with torch.no_grad():
        result = engine.forward_backward_batch(data, mean_negative_log_prob, forward_only=True)
    rows = result["model_output"]["log_probs"].unbind()
    return [row[: n - 1].float() for row, n in zip(rows, lengths, strict=True)]


@pytest.mark.parametrize(
    ("config_class", "hub"),
    [(transformers.Qwen3_5MoeTextConfig, False), (transformers.Qwen3_5MoeConfig, True),
     (transformers.Qwen3_5Config, True), (transformers.Qwen3NextConfig, False)],
)  # fmt: skip
def test_the_gdn_hybrids_are_covered_by_the_weight_path_fallback(config_class, hub):
    """``vanilla_mbridge=False`` without Megatron-Bridge builds these through the plugin's own
    bridges (``hf_qwen3_5``; the hub form, vision tower included, ``hf_qwen3_5_vl``)."""
    from mcore_npu.integrations.verl.weight_path import uncovered_reason

    config = config_class()
    assert (getattr(config, "vision_config", None) is not None) == hub
    assert uncovered_reason(config) is None


FORWARD_CHAIN = [
    "npu_chunk_local_cumsum",
    "npu_chunk_scaled_dot_kkt",
    "npu_solve_tri",
    "npu_recompute_w_u_fwd",
    "npu_chunk_gated_delta_rule_fwd_h",
    "npu_chunk_fwd_o",
]
BACKWARD_CHAIN = ["npu_recompute_w_u_fwd", "npu_chunk_gated_delta_rule_fwd_h",
                  "npu_chunk_bwd_dv_local", "npu_chunk_gated_delta_rule_bwd_dhu",
                  "npu_chunk_bwd_dqkwg", "npu_prepare_wy_repr_bwd_da",
                  "npu_prepare_wy_repr_bwd_full", "npu_chunk_local_cumsum"]  # fmt: skip
CHAIN_LENGTHS = (64, 40, 9)  # bshd rows of 64 tokens: whole chunks, as the stand-in computes


def _max_diff(rows, others) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(rows, others, strict=True))


def test_the_ascend_kernels_stand_ins_see_the_documented_calls_through_verl(
    qwen3_5_moe, monkeypatch
):
    """The nightly recipe's keys (full recompute), bshd, the bf16 model as verl loads it.

    On an NPU the GDN layers' dispatch (``kernel=None``: auto) sends verl's forward-only log-prob
    pass (no gradients) to torch_npu's forward-only ``npu_chunk_gated_delta_rule`` and a training
    step to the trainable fla_npu chain (bf16, K = V = 128). CPU tensors make auto pick the
    reference, so the layers are given the kernel by name (their constructor argument
    ``kernel``) on this engine's model; the stand-ins are ``tests/gated_delta_standin.py``'s.
    """
    engine, _ = _engine(qwen3_5_moe, BY_NAME["qwen3_5_moe_full_recompute"]["keys"], thd=False)
    engine.module = engine._build_megatron_module()
    gdn = [m for m in engine_model(engine).modules() if isinstance(m, NPUGatedDeltaNet)]
    data, _ = packed_batch(CHAIN_LENGTHS)
    reference = _forward_only_log_probs(engine, data, CHAIN_LENGTHS)

    torch_npu = install_torch_npu(monkeypatch)  # 1. forward only: torch_npu's kernel
    for layer in gdn:
        layer.kernel = "torch_npu"
    forward_only = _max_diff(_forward_only_log_probs(engine, data, CHAIN_LENGTHS), reference)
    _check_torch_npu_calls(torch_npu.calls, layers=len(gdn))

    fla_npu = install_fla_npu(monkeypatch)  # 2. a training step: the fla_npu chain
    for layer in gdn:
        layer.kernel = "fla_npu"
    result = engine.forward_backward_batch(data, mean_negative_log_prob)
    rows = result["model_output"]["log_probs"].unbind()
    chain = _max_diff([r[: n - 1].float() for r, n in zip(rows, CHAIN_LENGTHS, strict=True)],
                      reference)  # fmt: skip
    _check_fla_npu_calls(fla_npu, layers=len(gdn))

    for layer in gdn:  # 3. the bf16 model's own round-off: the same weights computed in fp32
        layer.kernel = None
    engine_model(engine).float()
    round_off = _max_diff(_forward_only_log_probs(engine, data, CHAIN_LENGTHS), reference)
    print(
        f"bf16 model, max |diff log p| against the reference kernel: stand-in torch_npu "
        f"{forward_only:.2e}, stand-in fla_npu {chain:.2e}; fp32 compute {round_off:.2e}"
    )
    assert max(forward_only, chain) <= round_off, (forward_only, chain, round_off)


def _check_torch_npu_calls(calls, *, layers: int) -> None:
    """One ``npu_chunk_gated_delta_rule`` per GDN layer in torch-npu 26.1.0's TND layout."""
    rows, seq = len(CHAIN_LENGTHS), max(CHAIN_LENGTHS)  # bshd: rows padded to the longest
    heads = [QWEN3_5_MOE[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                      "linear_key_head_dim", "linear_value_head_dim")]  # fmt: skip
    nk, nv, dk, dv = heads
    assert [name for name, _, _ in calls] == ["npu_chunk_gated_delta_rule"] * layers
    for _, shapes, kw in calls:
        assert shapes == ((rows * seq, nk, dk), (rows * seq, nk, dk), (rows * seq, nv, dv))
        assert kw["beta"].shape == kw["g"].shape == (rows * seq, nv)
        assert kw["beta"].dtype == torch.bfloat16 and kw["g"].dtype == torch.float32
        assert kw["initial_state"].shape == (rows, nv, dv, dk)
        assert kw["actual_seq_lengths"].dtype == torch.int32
        assert kw["actual_seq_lengths"].tolist() == [seq] * rows
        assert kw["scale"] == pytest.approx(dk**-0.5)


def _check_fla_npu_calls(recorder, *, layers: int) -> None:
    """Per GDN layer, the documented chains: forward, then (backward pass, last layer first)
    the full recompute's forward and the backward chain."""
    names, chains = recorder.names(), []
    while names:
        for kind, chain in (("forward", FORWARD_CHAIN), ("backward", BACKWARD_CHAIN)):
            if names[: len(chain)] == chain:
                chains.append(kind)
                names = names[len(chain) :]
                break
        else:
            raise AssertionError(f"not a documented chain: {names[: len(BACKWARD_CHAIN)]}")
    assert chains == ["forward"] * layers + ["forward", "backward"] * layers, chains
    shapes = {s[0] for name, s, _ in recorder.calls if name == "npu_chunk_fwd_o"}
    value_heads = QWEN3_5_MOE["linear_num_value_heads"]
    assert shapes == {(len(CHAIN_LENGTHS), value_heads, max(CHAIN_LENGTHS), 128)}


MEMORY_SEQS = (2048, 4096)


def _peak_per_step(run, seq: int):
    """``(peak bytes, largest single allocation)`` of one forward-only step over two rows of
    ``seq`` and ``3/4 seq`` tokens (the second right-padded in bshd), by the allocation tracker."""
    from mcore_npu.tools.bench.memory import track_allocations

    lengths = (seq, 3 * seq // 4)
    data, _ = packed_batch(lengths)
    with torch.no_grad(), track_allocations() as usage:
        run(data, lengths)
    return usage.peak_bytes, max(usage.sizes)


def test_the_hub_recipes_bshd_step_allocates_o_s_for_masks(qwen3_5_moe_hub, monkeypatch):
    """The nightly recipe's keys on the hub form in bshd, verl's log-prob pass at S = 2048 and
    4096: the peak and the largest single allocation grow as S (x2), so no mask of S x S
    entries is made (verl's ``[B, 1, S, S]`` alone would be B·S² bytes, x4). The control, in the
    same run: verl's own bshd forward as it runs on an NPU (``is_npu_available``: its
    ``_build_npu_attn_mask``, which the plugin takes as a dense mask) allocates B·S² bytes in
    one tensor, and that allocation grows as S²."""
    from verl.models.mcore import util as verl_util
    from verl.models.mcore.model_forward import gptmodel_forward_model_engine

    engine, _ = _engine(qwen3_5_moe_hub, BY_NAME["qwen3_5_moe_full_recompute"]["keys"], thd=False)
    engine.module = engine._build_megatron_module()
    model = engine.module[0]

    def plugin(data, lengths):
        _forward_only_log_probs(engine, data, lengths)

    def verl_on_npu(data, lengths):
        gptmodel_forward_model_engine(model, data["input_ids"], {}, data_format="bshd")

    ours = {seq: _peak_per_step(plugin, seq) for seq in MEMORY_SEQS}
    monkeypatch.setattr(verl_util, "is_npu_available", True)  # stand-in: torch_npu present
    control = {seq: _peak_per_step(verl_on_npu, seq) for seq in MEMORY_SEQS}
    small, large = MEMORY_SEQS
    growth = {name: tuple(usage[large][i] / usage[small][i] for i in (0, 1))
              for name, usage in (("plugin", ours), ("verl", control))}  # fmt: skip
    mib = 2**20
    for name, usage in (("plugin", ours), ("verl", control)):
        print(
            f"{name}: peak {usage[small][0] / mib:.1f} -> {usage[large][0] / mib:.1f} MiB "
            f"(x{growth[name][0]:.2f}), largest allocation {usage[small][1] / mib:.1f} -> "
            f"{usage[large][1] / mib:.1f} MiB (x{growth[name][1]:.2f}), S = {small} -> {large}"
        )
    assert max(growth["plugin"]) < 2.5  # O(S): twice the tokens, twice the bytes
    assert growth["verl"][1] > 3.5 and control[large][1] >= 2 * large * large  # O(S^2) seen
