"""verl 0.9.1's ``TrainingWorker`` with the optimizer keys of verl's Ascend recipes, verbatim.

Every distinct set of ``optim.*`` / ``override_optimizer_config.*`` keys (and the engine offload
keys that come with it) of the 31 recipes in ``recipe_settings.md`` (rows named per case), on the
tiny Qwen3 in bf16, one CPU process: ``worker.reset()`` builds the model and Megatron's
distributed optimizer over the plugin's ``PrecisionAwareAdam`` (megatron-core 0.16.1 without
Transformer Engine raises a raw ``TypeError`` for them), and two ``train_batch`` steps give a
finite loss and a finite, non-zero grad norm. The first step's loss (before any update) equals
the plain optimizer's, and the second stays within bf16 rounding of it. A value the plugin cannot
keep (fp8 moments) is refused in one line before any model exists.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

pytest.importorskip("verl")

from mcore_npu.optimizer import plugin_adams
from tests.integrations import verl_loop as loop

pytestmark = pytest.mark.usefixtures("cpu_runtime")

OFFLOAD = {"optimizer_cpu_offload": True, "use_precision_aware_optimizer": True}
CASES = {  # name: (optim fields, override_optimizer_config, engine fields)
    "rows_1_9_24_25": ({}, {**OFFLOAD, "optimizer_offload_fraction": 1},
                       {"param_offload": True, "optimizer_offload": True, "grad_offload": True}),
    "row_2": ({"weight_decay": 0.1, "clip_grad": 1.0},
              {**OFFLOAD, "optimizer_offload_fraction": 0.9, "overlap_cpu_optimizer_d2h_h2d": True},
              {}),
    "rows_11_13_16_18_19_26_29": ({}, {**OFFLOAD, "optimizer_offload_fraction": 1,
                                       "overlap_cpu_optimizer_d2h_h2d": True},
                                  {"param_offload": True, "optimizer_offload": True}),
    "rows_22_30": ({"use_precision_aware_optimizer": True, "main_grads_dtype": "fp32",
                    "exp_avg_dtype": "fp32", "exp_avg_sq_dtype": "fp32"},
                   {"main_params_dtype": "fp32", "optimizer_cpu_offload": True,
                    "optimizer_offload_fraction": 0.40, "overlap_cpu_optimizer_d2h_h2d": False},
                   {"param_offload": True, "optimizer_offload": True,
                    "override_ddp_config": {"grad_reduce_in_fp32": False}}),
    "row_6_swap_optimizer": ({}, {}, {"override_transformer_config": {"swap_optimizer": True}}),
}  # fmt: skip


def _config(model: str, optim: dict, override: dict, engine: dict):
    engine = {k: v for k, v in engine.items() if k != "grad_offload"}  # not a verl 0.9.1 key
    config = loop.worker_config(model, **loop.FAMILY_SETTINGS["qwen3"], **engine)
    optimizer = dataclasses.replace(config.optimizer_config, **optim,
                                    override_optimizer_config=dict(override))  # fmt: skip
    return dataclasses.replace(config, optimizer_config=optimizer)


@pytest.fixture(scope="module")
def plain_losses(qwen3) -> list[float]:
    worker = loop.new_worker(_config(qwen3, {}, {}, {}), loop.sft_loss_fn())
    return [m["loss"] for m in loop.train_sft(worker, 2)]


@pytest.mark.parametrize("name", CASES)
def test_recipe_optimizer_keys_train_through_training_worker(qwen3, plain_losses, name):
    optim, override, engine = CASES[name]
    worker = loop.new_worker(_config(qwen3, optim, override, engine), loop.sft_loss_fn())
    (adam,) = plugin_adams(worker.engine.optimizer)
    fraction = override.get("optimizer_offload_fraction", 1.0)
    assert adam.settings.cpu_offload and adam.settings.offload_fraction == fraction
    metrics = loop.train_sft(worker, 2)
    losses = [m["loss"] for m in metrics]
    norms = [m["grad_norm"] for m in metrics]
    assert all(math.isfinite(x) for x in losses + norms) and all(n > 0 for n in norms), metrics
    assert losses[0] == plain_losses[0]
    assert abs(losses[1] - plain_losses[1]) <= 2e-2 * abs(plain_losses[1]), (losses, plain_losses)
    assert adam.state_bytes()["host"] > 0


def test_verl_alone_leaves_a_dtype_string_that_megatron_asserts_on():
    """The control of rows 22 / 30: verl's ``init_megatron_optim_config`` copies
    ``main_params_dtype="fp32"`` from ``override_optimizer_config`` as the string, and
    megatron-core 0.16.1's ``OptimizerConfig`` (``optimizer_config.py:418-420``) asserts; the
    plugin reads it as ``torch.float32``."""
    import torch
    from verl.utils.megatron.optimizer import init_megatron_optim_config
    from verl.workers.config import McoreOptimizerConfig

    from mcore_npu.integrations.verl.optimizer import requested_keys
    from mcore_npu.optimizer import AdamSettings

    config = McoreOptimizerConfig(lr=1e-3, override_optimizer_config={"main_params_dtype": "fp32"})
    with pytest.raises(AssertionError, match="main_params_dtype"):
        init_megatron_optim_config(config)
    keys = requested_keys(config, bf16=True)
    assert AdamSettings.from_keys(keys).main_params_dtype == torch.float32


def test_fp8_moments_are_refused_in_one_line_before_any_model(qwen3):
    config = _config(qwen3, {}, {**OFFLOAD, "exp_avg_dtype": "fp8"}, {})
    with pytest.raises(ValueError, match="exp_avg_dtype='fp8'") as info:
        loop.new_worker(config, loop.sft_loss_fn())
    assert "\n" not in str(info.value)


def test_optimizer_key_table_covers_the_census_and_the_docs_show_it():
    from pathlib import Path

    import yaml

    from mcore_npu.integrations.verl.optimizer import render_key_table

    root = Path(__file__).parents[2]
    table = yaml.safe_load((root / "mcore_npu/specs/recipe_optimizer_keys.yaml").read_text())
    assert set(table["census"]) == set(table["keys"])
    page = (root / "docs/optimizer.md").read_text()
    assert render_key_table() in page, "python -m mcore_npu.integrations.verl.optimizer"


@pytest.mark.parametrize("fully_reshardable", [False, True], ids=["dp_reshardable", "fully"])
@pytest.mark.parametrize("fraction", [1.0, 0.4])
def test_resume_through_verls_checkpoint_in_a_fresh_worker(qwen3, tmp_path, fraction,
                                                           fully_reshardable):  # fmt: skip
    """verl's ``save_checkpoint`` / ``load_checkpoint`` (Megatron's distributed-optimizer formats
    through ``get_unscaled_state`` / ``set_scaled_state``) with the precision-aware Adam and the
    CPU offload, ``param_offload`` and ``optimizer_offload`` on: a fresh worker continues like the
    uninterrupted one (step 3 equal), every parameter's step restored, and the offloaded part's
    state back in the optimizer's host placement."""
    override = {**OFFLOAD, "optimizer_offload_fraction": fraction}
    engine = {"param_offload": True, "optimizer_offload": True,
              "dist_ckpt_optim_fully_reshardable": fully_reshardable}  # fmt: skip
    config = _config(qwen3, {}, override, engine)
    worker = loop.new_worker(config, loop.sft_loss_fn())
    loop.train_sft(worker, 2)
    worker.save_checkpoint(str(tmp_path), global_step=2)
    later = [m["loss"] for m in loop.train_sft(worker, 1)]
    fresh = loop.new_worker(_config(qwen3, {}, override, engine), loop.sft_loss_fn())
    fresh.load_checkpoint(str(tmp_path))
    (adam,) = plugin_adams(fresh.engine.optimizer)
    assert {float(state["step"]) for state in adam.state.values()} == {2.0}
    (before,) = plugin_adams(worker.engine.optimizer)
    assert adam.state_bytes() == before.state_bytes()
    resumed = [m["loss"] for m in loop.train_sft(fresh, 1)]
    assert resumed == later
