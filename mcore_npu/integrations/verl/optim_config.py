"""The optimizer dtypes of a verl optimizer config, as torch dtypes.

verl 0.9.1's ``init_megatron_optim_config`` (``verl/utils/megatron/optimizer.py``) converts three
dtype strings of ``optim`` with ``PrecisionType.to_dtype`` (``main_grads_dtype``,
``exp_avg_dtype``, ``exp_avg_sq_dtype``, and only with ``use_precision_aware_optimizer=True``),
then copies ``override_optimizer_config`` into Megatron's ``OptimizerConfig`` as it is. A dtype
a recipe writes there (``+...optim.override_optimizer_config.main_params_dtype=fp32``, recipe
22) reaches Megatron as the string ``"fp32"``, which its optimizers compare with torch dtypes.

:func:`optimizer_dtypes` reads the four dtypes the way verl layers them (the top-level field,
then ``override_optimizer_config``, which wins, as in verl's copy) and converts every one. The
plugin's optimizer build calls it; it changes nothing in the config it is given.
"""

from __future__ import annotations

import torch

__all__ = ["DTYPE_KEYS", "optimizer_dtypes", "to_dtype"]

DTYPE_KEYS = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")

# the spellings accepted for each dtype (strings compare lower-cased, a "torch." prefix dropped);
# "32" / "16" / 32 / 16 are verl's own (verl.utils.torch_dtypes.FLOAT_LIST / HALF_LIST)
_NAMES = {
    torch.float32: ("fp32", "float32", "32"),
    torch.bfloat16: ("bf16", "bfloat16"),
    torch.float16: ("fp16", "float16", "16"),
}
_BY_NAME = {name: dtype for dtype, names in _NAMES.items() for name in names}
_BY_NUMBER = {32: torch.float32, 16: torch.float16}
_FP8_MARKS = ("fp8", "float8", "e4m3", "e5m2", "uint8")
ACCEPTED = "'fp32'/'float32', 'bf16'/'bfloat16', 'fp16'/'float16' or a torch dtype of those"


def optimizer_dtypes(optim_config) -> dict[str, torch.dtype]:
    """``{main_grads_dtype, main_params_dtype, exp_avg_dtype, exp_avg_sq_dtype} -> torch dtype``.

    Args:
        optim_config: verl's optimizer config (``McoreOptimizerConfig``, an OmegaConf node or a
            plain dict). Each key is read from ``optim_config.override_optimizer_config`` if set
            there, else from ``optim_config`` itself, else it is fp32 (Megatron's default).
            ``None`` counts as not set.

    Raises:
        ValueError: a value that is not fp32 / bf16 / fp16 (fp8 dtypes included), naming the
            key, the value and the accepted values.
    """
    override = _get(optim_config, "override_optimizer_config") or {}
    dtypes = {}
    for key in DTYPE_KEYS:
        value = _get(override, key)
        where = f"override_optimizer_config.{key}"
        if value is None:
            value, where = _get(optim_config, key), key
        dtypes[key] = torch.float32 if value is None else to_dtype(value, f"optim.{where}")
    return dtypes


def to_dtype(value, key: str) -> torch.dtype:
    """``value`` (a string or number of verl's spellings, or a torch dtype) as fp32 / bf16 /
    fp16; ``key`` names the setting in the error."""
    if isinstance(value, torch.dtype):
        dtype = value if value in _NAMES else None
        name = str(value).removeprefix("torch.")
    elif isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        dtype = _BY_NAME.get(name)
    elif isinstance(value, int) and not isinstance(value, bool):
        dtype, name = _BY_NUMBER.get(value), str(value)
    else:
        dtype, name = None, ""
    if dtype is not None:
        return dtype
    if any(mark in name for mark in _FP8_MARKS):
        raise ValueError(
            f"{key}={value!r}: fp8 optimizer state is not supported; the plugin's "
            f"precision-aware Adam keeps its state in fp32, bf16 or fp16: use {ACCEPTED}"
        )
    raise ValueError(f"{key}={value!r} ({type(value).__name__}) is not a dtype; use {ACCEPTED}")


def _get(config, key: str):
    """``config[key]`` for a mapping, ``config.key`` for an object; ``None`` if absent."""
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(key)
    getter = getattr(config, "get", None)
    if callable(getter):  # OmegaConf nodes and verl's BaseConfig (a Mapping)
        try:
            return getter(key, None)
        except (AttributeError, KeyError, TypeError):
            pass
    return getattr(config, key, None)
