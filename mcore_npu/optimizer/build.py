"""Megatron's optimizer, built by Megatron, with the plugin's Adam inside where Megatron has none.

Without TE megatron-core builds neither the precision-aware optimizer nor the CPU offload.
:func:`get_megatron_optimizer` runs Megatron's own build on a config with both off (and
``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` set, so the distributed optimizer shards the
model's parameters and hands out ``decoupled_grad``), then swaps each still-empty torch Adam for
a :class:`~.adam.PrecisionAwareAdam` over the same param groups. Megatron's modules are not
changed; when nothing needs the plugin's Adam, Megatron's build runs unchanged (docs/optimizer.md).
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from .adam import PrecisionAwareAdam
from .settings import AdamSettings

__all__ = ["OPTIMIZER_KEYS", "get_megatron_optimizer", "optimizer_members", "plugin_adams"]

log = logging.getLogger(__name__)

OPTIMIZER_KEYS = (
    "use_precision_aware_optimizer",
    "main_grads_dtype",
    "main_params_dtype",
    "exp_avg_dtype",
    "exp_avg_sq_dtype",
    "store_param_remainders",
    "optimizer_cpu_offload",
    "optimizer_offload_fraction",
    "overlap_cpu_optimizer_d2h_h2d",
)


def get_megatron_optimizer(config_keys: dict, model_chunks: list, **megatron_kwargs):
    """Megatron's optimizer for DDP-wrapped ``model_chunks`` from ``OptimizerConfig`` field
    values (dtypes as ``torch.dtype`` or names such as ``"bf16"``); ``megatron_kwargs`` go to
    Megatron's ``get_megatron_optimizer``. A key that cannot work raises, naming the fix."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer as megatron_build

    settings = AdamSettings.from_keys(config_keys)
    settings.check_against(
        optimizer=config_keys.get("optimizer", "adam"),
        use_distributed_optimizer=bool(config_keys.get("use_distributed_optimizer", False)),
    )
    if not _needs_plugin_adam(settings):
        config = OptimizerConfig(**_megatron_values(config_keys))
        return megatron_build(config, model_chunks, **megatron_kwargs)
    plain = {k: v for k, v in config_keys.items() if k not in OPTIMIZER_KEYS}
    config = OptimizerConfig(**plain)
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = settings.precision_aware
    optimizer = megatron_build(config, model_chunks, **megatron_kwargs)
    _install(optimizer, settings)
    for member in {id(m.config): m.config for m in optimizer_members(optimizer)}.values():
        _record(member, settings)
    log.info(
        "mcore_npu: Megatron's optimizer over the plugin's PrecisionAwareAdam (%s)",
        ", ".join(f"{k}={getattr(config, k)}" for k in OPTIMIZER_KEYS),
    )
    return optimizer


def _needs_plugin_adam(settings: AdamSettings) -> bool:
    if settings.cpu_offload:
        return True  # Megatron's offload is CUDA-only, TE or not
    return settings.precision_aware and importlib.util.find_spec("transformer_engine") is None


def _megatron_values(config_keys: dict) -> dict:
    """Dtype names converted (``"fp32"`` -> ``torch.float32``) for Megatron's own build."""
    from .settings import DTYPE_KEYS, parse_dtype

    return {k: parse_dtype(k, v) if k in DTYPE_KEYS else v for k, v in config_keys.items()}


def optimizer_members(optimizer) -> list:
    """The optimizers inside ``optimizer``: a ``ChainedOptimizer``'s members, or itself."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def plugin_adams(optimizer) -> list[PrecisionAwareAdam]:
    """Every :class:`PrecisionAwareAdam` inside a Megatron optimizer."""
    inner = [getattr(m, "optimizer", None) for m in optimizer_members(optimizer)]
    return [adam for adam in inner if isinstance(adam, PrecisionAwareAdam)]


def _install(optimizer, settings: AdamSettings) -> None:
    for member in optimizer_members(optimizer):
        inner = getattr(member, "optimizer", None)
        if inner is None:
            continue  # a rank without parameters: Megatron's stub optimizer
        if not isinstance(inner, torch.optim.Adam) or inner.state:
            raise TypeError(
                f"mcore_npu: expected Megatron to build an empty torch Adam, got {type(inner)}"
            )
        adam = PrecisionAwareAdam.replacing(inner, settings)
        member.optimizer = adam
        member.init_state_fn = lambda opt, config=None: opt.initialize_all_state()


def _record(config, settings: AdamSettings) -> None:
    """The config object (here or Megatron's copy) says what the optimizer does."""
    config.use_precision_aware_optimizer = settings.precision_aware
    config.optimizer_cpu_offload = settings.cpu_offload
    config.optimizer_offload_fraction = settings.offload_fraction
    config.overlap_cpu_optimizer_d2h_h2d = settings.overlap_copies
    config.store_param_remainders = settings.store_param_remainders
    for key in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        setattr(config, key, getattr(settings, key))
