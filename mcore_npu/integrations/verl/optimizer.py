"""verl's optimizer settings, built into Megatron's optimizer with the plugin's Adam.

verl's ``init_megatron_optim_config`` passes the precision-aware and offload keys to Megatron's
``OptimizerConfig``, which cannot build them without Transformer Engine or CUDA. Here the same keys,
with verl's precedence, are split: :func:`requested_keys` reads them (and those the recipe's
``swap_optimizer`` maps to), :func:`without_plugin_keys` leaves verl the rest, and
:func:`build_optimizer` hands both to :func:`mcore_npu.optimizer.get_megatron_optimizer`.
See docs/optimizer.md.
"""

from __future__ import annotations

import dataclasses

import torch

from mcore_npu.optimizer import OPTIMIZER_KEYS, get_megatron_optimizer

__all__ = ["build_optimizer", "grad_reduce_in_fp32", "requested_keys", "without_plugin_keys"]

_TOP_LEVEL_DTYPES = ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")


def _override(optim_config) -> dict:
    return dict(optim_config.get("override_optimizer_config") or {})


def requested_keys(optim_config, *, bf16: bool, recipe_keys: dict | None = None) -> dict:
    """The precision / offload keys of verl's ``optim`` section (``McoreOptimizerConfig``), as
    verl would pass them: the top-level precision-aware keys only for a ``bf16`` model, then
    ``override_optimizer_config``; ``recipe_keys`` (from ``swap_optimizer``) lowest."""
    keys = dict(recipe_keys or {})
    if bf16 and optim_config.get("use_precision_aware_optimizer", False):
        keys["use_precision_aware_optimizer"] = True
        keys.update({key: optim_config.get(key, "fp32") for key in _TOP_LEVEL_DTYPES})
    keys.update({k: v for k, v in _override(optim_config).items() if k in OPTIMIZER_KEYS})
    return keys


def without_plugin_keys(optim_config):
    """A copy of ``optim_config`` without the keys :func:`requested_keys` reads."""
    rest = {k: v for k, v in _override(optim_config).items() if k not in OPTIMIZER_KEYS}
    return dataclasses.replace(
        optim_config, use_precision_aware_optimizer=False, override_optimizer_config=rest
    )


def build_optimizer(engine, recipe_keys: dict | None = None):
    """Megatron's optimizer for ``engine.module`` from ``engine.optimizer_config``: verl's own
    config translation for every other key, the plugin's build for the requested ones."""
    from verl.utils.megatron.optimizer import init_megatron_optim_config

    bf16 = engine.param_dtype == torch.bfloat16
    config = init_megatron_optim_config(
        without_plugin_keys(engine.optimizer_config),
        use_distributed_optimizer=engine.engine_config.use_distributed_optimizer,
        fp16=engine.param_dtype == torch.float16,
        bf16=bf16,
    )
    keys = {
        field.name: getattr(config, field.name)
        for field in dataclasses.fields(config)
        if field.init and field.name != "use_precision_aware_optimizer_no_fp8_or_ds_fp8"
    }
    keys.update(requested_keys(engine.optimizer_config, bf16=bf16, recipe_keys=recipe_keys))
    return get_megatron_optimizer(keys, engine.module)


def grad_reduce_in_fp32(optim_config, *, bf16: bool, recipe_keys: dict | None = None) -> bool:
    """verl's rule for the DDP grad buffer (``_resolve_override_ddp_config``), on the keys as
    :func:`requested_keys` reads them (``override_optimizer_config`` included): fp32 unless the
    precision-aware optimizer asks for lower-precision main gradients."""
    from mcore_npu.optimizer import parse_dtype

    keys = requested_keys(optim_config, bf16=bf16, recipe_keys=recipe_keys)
    if not keys.get("use_precision_aware_optimizer", False):
        return True
    return parse_dtype("main_grads_dtype", keys.get("main_grads_dtype", "fp32")) == torch.float32


def render_key_table(path: str | None = None) -> str:
    """The Markdown table of ``specs/recipe_optimizer_keys.yaml`` (docs/optimizer.md holds it)."""
    from pathlib import Path

    import yaml

    table = Path(path or Path(__file__).parents[2] / "specs" / "recipe_optimizer_keys.yaml")
    keys = yaml.safe_load(table.read_text())["keys"]
    where = {"verl": "verl, unchanged", "plugin": "**the plugin**"}
    rows = ["| key | handled by | what it does |", "|---|---|---|"]
    rows += [f"| `{key}` | {where[entry['do']]} | {entry['what']} |" for key, entry in keys.items()]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(render_key_table(), end="")
