"""``mcore_npu.integrations.verl.optim_config.optimizer_dtypes``: the four optimizer dtypes of a
verl optimizer config (verl 0.9.1's ``McoreOptimizerConfig``, an OmegaConf node or a dict) as
torch dtypes, the strings verl leaves in ``override_optimizer_config`` included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from omegaconf import OmegaConf
from verl.workers.config import McoreOptimizerConfig

from mcore_npu.integrations.verl.optim_config import DTYPE_KEYS, optimizer_dtypes

FP32 = dict.fromkeys(DTYPE_KEYS, torch.float32)


def test_verl_leaves_an_override_dtype_as_a_string_and_megatron_asserts():
    """The control: verl's ``init_megatron_optim_config`` copies ``main_params_dtype="fp32"``
    from ``override_optimizer_config`` as the string, and megatron-core 0.16.1's
    ``OptimizerConfig.__post_init__`` (``optimizer_config.py:418-420``) compares it with
    ``torch.float32``: a raw ``AssertionError``."""
    from verl.utils.megatron.optimizer import init_megatron_optim_config

    config = McoreOptimizerConfig(lr=1e-3, override_optimizer_config={"main_params_dtype": "fp32"})
    with pytest.raises(AssertionError, match="main_params_dtype"):
        init_megatron_optim_config(config)


def test_defaults_are_fp32():
    assert optimizer_dtypes(McoreOptimizerConfig(lr=1e-3)) == FP32
    assert optimizer_dtypes({}) == FP32
    assert optimizer_dtypes({"override_optimizer_config": None, "exp_avg_dtype": None}) == FP32


def test_recipe_22_verbatim():
    """Recipe 22 (``recipe_settings.md``): the three dtypes at the top of ``optim`` and
    ``main_params_dtype`` inside ``override_optimizer_config``, all ``fp32``."""
    config = McoreOptimizerConfig(
        lr=1e-5, use_precision_aware_optimizer=True, main_grads_dtype="fp32",
        exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32",
        override_optimizer_config={"main_params_dtype": "fp32", "optimizer_cpu_offload": True},
    )  # fmt: skip
    assert optimizer_dtypes(config) == FP32


def test_override_wins_over_the_top_level_field_and_the_input_is_unchanged():
    """verl copies ``override_optimizer_config`` over the converted fields, so its value wins."""
    override = {"exp_avg_dtype": "fp16", "main_params_dtype": torch.bfloat16}
    config = McoreOptimizerConfig(lr=1e-3, exp_avg_dtype="bf16", exp_avg_sq_dtype="bfloat16",
                                  main_grads_dtype="bf16", override_optimizer_config=override)  # fmt: skip
    assert optimizer_dtypes(config) == {
        "main_grads_dtype": torch.bfloat16,
        "main_params_dtype": torch.bfloat16,
        "exp_avg_dtype": torch.float16,
        "exp_avg_sq_dtype": torch.bfloat16,
    }
    assert override == {"exp_avg_dtype": "fp16", "main_params_dtype": torch.bfloat16}
    assert config.exp_avg_dtype == "bf16"


SPELLINGS = [
    ("fp32", torch.float32), ("float32", torch.float32), ("FP32", torch.float32),
    ("torch.float32", torch.float32), (torch.float32, torch.float32), ("32", torch.float32),
    ("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), (torch.bfloat16, torch.bfloat16),
    ("fp16", torch.float16), ("float16", torch.float16), (torch.float16, torch.float16),
]  # fmt: skip


@pytest.mark.parametrize(("value", "dtype"), SPELLINGS, ids=[str(v) for v, _ in SPELLINGS])
@pytest.mark.parametrize("key", DTYPE_KEYS)
def test_every_spelling_of_every_key(key, value, dtype):
    as_dict = optimizer_dtypes({"override_optimizer_config": {key: value}})
    as_omegaconf = optimizer_dtypes(OmegaConf.create({key: str(value).removeprefix("torch.")}))
    assert as_dict == {**FP32, key: dtype}
    assert as_omegaconf == {**FP32, key: dtype}


FP8 = ["fp8", "float8_e4m3fn", "fp8_e5m2", torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8]


@pytest.mark.parametrize("value", FP8, ids=[str(v) for v in FP8])
def test_fp8_state_is_refused_in_one_line(value):
    with pytest.raises(ValueError) as refused:
        optimizer_dtypes({"override_optimizer_config": {"exp_avg_dtype": value}})
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"optim.override_optimizer_config.exp_avg_dtype={value!r}")
    assert "fp8" in message and "fp32, bf16 or fp16" in message


BAD = ["fp64", "int8", "", torch.float64, torch.int32, 3.5, True, 8, ["fp32"]]


@pytest.mark.parametrize("value", BAD, ids=[repr(v) for v in BAD])
def test_anything_else_is_refused_naming_key_value_and_the_accepted_values(value):
    with pytest.raises(ValueError) as refused:
        optimizer_dtypes({"main_grads_dtype": value})
    message = str(refused.value)
    assert message.startswith(f"optim.main_grads_dtype={value!r}")
    assert "'fp32'/'float32', 'bf16'/'bfloat16', 'fp16'/'float16'" in message
