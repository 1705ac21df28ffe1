"""Nemotron-H (a Mamba2 hybrid, NVIDIA-Nemotron-Nano-9B-v2's ``model_type``) through verl 0.9.1's
``TrainingWorker`` and the plugin's engine, with the key set of the public Ascend recipe
(verl-ascend-recipe @c1cf54fa788f ``grpo/nemotron-nano-9b-v2/run_nemotron_nano_9b_v2_grpo_
megatron_npu.sh``) verbatim from ``recipe_settings.yaml`` row 23 (TP 8 there, one process here).
No stand-ins: the model is Nemotron-H.

- The tiny ``nemotron_h`` checkpoint (conftest's ``save_tiny_nemotron_h``, transformers 5.10.4):
  pattern ``M*M-M*`` (3 Mamba2, 2 attention, 1 MLP layer), chunk 4 (the rows have 5 to 14
  tokens), every norm, ``D`` and ``dt_bias`` away from its init, weights rounded to bf16.
- The recipe's ``vanilla_mbridge=False``: Megatron-Bridge does not import here, so the engine
  builds the model through the plugin's ``NemotronHBridge`` (``weight_path.py``'s fallback):
  Megatron's ``MambaModel`` from ``get_hybrid_stack_npu_spec``. The recipe's
  ``override_transformer_config`` goes in unchanged; its full recompute reaches the model.
- One forward and backward through verl's ``forward_backward_batch``, the bf16-loaded weights
  computed in fp32: log-probs within 1e-3 of 5.10.4's ``NemotronHForCausalLM`` (fp32) in bshd
  (the recipe's ``use_remove_padding=False``) and thd; every Mamba parameter gets a finite,
  non-zero gradient. The reference runs each row as one chunk (``chunk_size=16``): 5.10.4's
  pure-torch scan sums the inter-chunk decay over the wrong axis (``torch_forward``:
  ``.sum(dim=2)``), which is off past the first chunk (checked below; 5.25 fixed it), and clamps
  ``softplus(dt + dt_bias)`` at ``time_step_min`` (Megatron and the CUDA path do not), made
  inert by the checkpoint's ``time_step_min=1e-9``.
- The recipe's keys (engine, optimizer, ``override_transformer_config``) train 2 ``train_batch``
  steps in bshd and thd: finite losses, non-zero grad norms, finite non-zero gradients on every
  Mamba parameter (``in_proj``, ``conv1d``, ``A_log``, ``D``, ``dt_bias``, ``norm``,
  ``out_proj``). The critic (value head) gives finite values in both layouts.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

import transformers
import yaml

from mcore_npu.integrations.verl.engine import (
    NPUMegatronEngineWithValueHead,
)
from mcore_npu.transformer.mamba import NPUMambaMixer
from tests.integrations import verl_loop as loop
from tests.integrations.conftest import (
    accumulated_grad,
    engine_model,
    lm_head_engine,
    training_worker_config,
)
from tests.integrations.log_probs import hf_log_probs, mean_negative_log_prob, packed_batch

pytestmark = pytest.mark.usefixtures("cpu_runtime", "own_attention_variables")

ROWS = yaml.safe_load((Path(__file__).parent / "recipe_settings.yaml").read_text())["rows"]
ROW = next(row for row in ROWS if row["row"] == "23")
AM = "actor_rollout_ref.actor.megatron."
LENGTHS = (12, 7, 5)
ONE_CHUNK = max(LENGTHS) + 4  # the reference's chunk_size: every row one chunk
TOLERANCE = 1e-3
MAMBA_PARAMETERS = {
    "in_proj.weight",
    "in_proj.layer_norm_weight",
    "conv1d.weight",
    "conv1d.bias",
    "A_log",
    "D",
    "dt_bias",
    "norm.weight",
    "out_proj.weight",
}


def _value(text: str):
    """A Hydra override's value: bool, int, float or the string."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _section(keys: list[str], prefix: str) -> dict:
    """``{field: value}`` of the row's ``+prefix.field=value`` keys."""
    pairs = (key.lstrip("+").split("=", 1) for key in keys)
    return {path[len(prefix) :]: _value(v) for path, v in pairs if path.startswith(prefix)}


RECIPE = _section(ROW["transformer_keys"], AM + "override_transformer_config.")
MEGATRON = _section(ROW["keys"], AM)  # param/optimizer offload, bridge, dtype, the layout
OPTIM = _section(ROW["keys"], "actor_rollout_ref.actor.optim.")
ENGINE = {k: v for k, v in MEGATRON.items() if k != "use_remove_padding"}  # the layout: per test
LAYOUTS = {"bshd": MEGATRON["use_remove_padding"], "thd": True}


def test_the_rows_keys_are_read_as_hydra_reads_them():
    """Every key of row 23 parsed (``1e-6`` a number, ``True`` a bool), the layout bshd."""
    assert len(RECIPE) == len(ROW["transformer_keys"]) and ROW["family"] == "nemotron_h"
    assert RECIPE["use_mamba_mem_eff_path"] is False and RECIPE["recompute_num_layers"] == 1
    assert ENGINE["vanilla_mbridge"] is False and ENGINE["dtype"] == "bfloat16"
    assert OPTIM["lr"] == 1e-6 and OPTIM["lr_warmup_steps"] == 10
    assert LAYOUTS["bshd"] is False


@pytest.fixture(scope="module")
def reference(nemotron_h) -> list[torch.Tensor]:
    """transformers 5.10.4's log-probs of the :func:`packed_batch` rows, fp32, one chunk a row."""
    return hf_log_probs(nemotron_h, LENGTHS, chunk_size=ONE_CHUNK)


def _engine(path: str, *, thd: bool):
    """``(engine with its model built, the worker's engine config)``: the recipe's keys."""
    config = training_worker_config(path, remove_padding=thd, override_transformer_config=RECIPE)
    return lm_head_engine(config, **ENGINE)


def _mixers(engine) -> list[NPUMambaMixer]:
    return [m for m in engine_model(engine).modules() if isinstance(m, NPUMambaMixer)]


def _mamba_gradients(engine) -> dict[str, torch.Tensor]:
    """``"{mixer}.{name}"`` -> the gradient of every parameter of every Mamba mixer."""
    mixers = _mixers(engine)
    assert len(mixers) == 3
    grads = {}
    for index, mixer in enumerate(mixers):
        named = dict(mixer.named_parameters())
        assert set(named) == MAMBA_PARAMETERS
        grads.update(
            {f"{index}.{name}": accumulated_grad(param).clone() for name, param in named.items()}
        )
    return grads


def _check_finite_non_zero(grads: dict[str, torch.Tensor]) -> None:
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert grad.abs().sum() > 0, f"{name}: zero gradient"


def _record_step_gradients(engine) -> list[dict[str, torch.Tensor]]:
    """Each optimizer step's Mamba gradients, read as the step starts (verl zeroes the gradient
    buffers when ``train_batch`` exits): a wrapper of this engine's ``optimizer.step``."""
    steps, step = [], engine.optimizer.step

    def recording_step(*args, **kwargs):
        steps.append(_mamba_gradients(engine))
        return step(*args, **kwargs)

    engine.optimizer.step = recording_step
    return steps


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nemotron_recipe_matches_transformers_with_mamba_gradients(layout, nemotron_h, reference):
    engine, worker_engine_config = _engine(nemotron_h, thd=LAYOUTS[layout])
    before = copy.deepcopy(dict(worker_engine_config.override_transformer_config))
    assert before == RECIPE  # the worker's config still holds the recipe as written
    assert engine.mbridge_fallback and not worker_engine_config.vanilla_mbridge
    assert type(engine.bridge).__name__ == "NemotronHBridge"
    assert engine.bridge.npu_spec_keywords == engine.npu_spec_keywords  # the recipe's, not GPT's
    model = engine_model(engine)
    assert type(model).__name__ in ("MambaModel", "HybridModel")
    assert engine.engine_config.use_remove_padding is LAYOUTS[layout]
    for key in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        assert getattr(engine.tf_config, key) == RECIPE[key]
    assert {m.chunk_size for m in _mixers(engine)} == {4}  # shorter than the rows
    model.float()  # the bf16-loaded weights, computed in fp32
    model.config.params_dtype = torch.float32  # Megatron's MambaLayer casts its input to it

    data, _ = packed_batch(LENGTHS)
    result = engine.forward_backward_batch(data, mean_negative_log_prob)
    rows = result["model_output"]["log_probs"].unbind()
    got = [row[: n - 1].float() for row, n in zip(rows, LENGTHS, strict=True)]
    error = max(float((g - w).abs().max()) for g, w in zip(got, reference, strict=True))
    print(f"nemotron_h ({layout}): max |log p - log p_hf| = {error:.2e}")
    assert error < TOLERANCE, f"nemotron_h ({layout}): max |log p - log p_hf| = {error:.2e}"
    _check_finite_non_zero(_mamba_gradients(engine))


def test_transformers_5_10_chunked_scan_is_off_past_the_first_chunk(nemotron_h):
    """Why the reference runs one chunk a row: 5.10.4's own Mamba layer at the checkpoint's
    chunk 4 differs from the same layer run as one chunk (no inter-chunk term, so exact) by more
    than the tolerance. When this fails, transformers has fixed it and the reference may use the
    checkpoint's chunk."""
    model = transformers.NemotronHForCausalLM.from_pretrained(nemotron_h, dtype=torch.float32)
    mixer = model.eval().model.layers[0].mixer
    inputs = torch.randn(
        1, max(LENGTHS), model.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        chunked = mixer.torch_forward(inputs)
        mixer.chunk_size = ONE_CHUNK
        whole = mixer.torch_forward(inputs)
    difference = float((chunked - whole).abs().max())
    print(f"transformers {transformers.__version__}: chunk 4 vs one chunk {difference:.2e}")
    assert difference > TOLERANCE


def _train_config(path: str, *, thd: bool, model_type: str = "language_model"):
    """verl's ``TrainingWorkerConfig`` with the recipe's engine, optimizer and transformer keys."""
    config = loop.worker_config(path, model_type=model_type, remove_padding=thd, total_steps=100)
    engine = dataclasses.replace(
        config.engine_config, override_transformer_config=dict(RECIPE), **ENGINE
    )
    optimizer = dataclasses.replace(config.optimizer_config, **OPTIM)
    return dataclasses.replace(config, engine_config=engine, optimizer_config=optimizer)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nemotron_recipe_trains_two_steps(layout, nemotron_h):
    """2 ``train_batch`` steps (verl's SFT loss): finite losses, non-zero grad norms, finite
    non-zero gradients on every Mamba parameter in each step. The recipe's warm-up (10 steps
    from lr 0) leaves the weights of step 1 unchanged: both steps give the same loss."""
    worker = loop.new_worker(_train_config(nemotron_h, thd=LAYOUTS[layout]), loop.sft_loss_fn())
    engine = worker.engine
    assert engine.mbridge_fallback and engine.engine_config.use_remove_padding is LAYOUTS[layout]
    steps = _record_step_gradients(engine)
    metrics = loop.train_sft(worker, 2)
    losses, norms = [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics]
    print(f"nemotron_h ({layout}): losses {losses}, grad norms {norms}")
    assert all(math.isfinite(x) for x in losses + norms) and all(n > 0 for n in norms), metrics
    assert len(steps) == 2
    for grads in steps:
        _check_finite_non_zero(grads)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nemotron_critic_gives_finite_values(layout, nemotron_h):
    """The critic (``value_model``) on the recipe's keys: the value head on the hybrid model,
    one value per response token of a rollout batch, finite."""
    from verl.utils import tensordict_utils as tu

    config = _train_config(nemotron_h, thd=LAYOUTS[layout], model_type="value_model")
    worker = loop.new_worker(config, loop.value_loss_fn())
    assert type(worker.engine) is NPUMegatronEngineWithValueHead
    data = loop.to_engine_layout(loop.rollout_batch(0), compute_loss=False)
    values = tu.get(worker.infer_batch(data), "values")
    tokens = sum(p + r for p, r in zip(loop.PROMPT_LENGTHS, loop.RESPONSE_LENGTHS, strict=True))
    assert values.values().numel() == tokens
    assert torch.isfinite(values.values()).all()
