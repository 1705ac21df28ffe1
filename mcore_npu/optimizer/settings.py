"""What a run asks of its Adam: Megatron's optimizer keys, read, checked and converted once.

The keys are Megatron's ``OptimizerConfig`` precision and offload fields, with their meanings
(docs/optimizer.md). A dtype may be a ``torch.dtype`` or a name (``fp32``, ``bf16``, ``fp16``,
``float32``, ..., verl's ``32`` / ``16``), as verl leaves ``main_params_dtype``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["AdamSettings", "DTYPE_KEYS", "parse_dtype"]

_NAMES = {  # "32" / "16" (and the numbers) are verl's own spellings (PrecisionType)
    "fp32": torch.float32,
    "float32": torch.float32,
    "32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "16": torch.float16,
}
_ALLOWED = {
    "main_grads_dtype": (torch.float32, torch.bfloat16, torch.float16),
    "main_params_dtype": (torch.float32, torch.float16),
    "exp_avg_dtype": (torch.float32, torch.bfloat16, torch.float16),
    "exp_avg_sq_dtype": (torch.float32, torch.bfloat16, torch.float16),
}
DTYPE_KEYS = tuple(_ALLOWED)


def parse_dtype(key: str, value: Any) -> torch.dtype:
    """``"bf16"`` / ``torch.bfloat16`` -> ``torch.bfloat16`` for the optimizer key ``key``
    (``ValueError`` for one ``key`` cannot be kept in, fp8 included)."""
    if isinstance(value, str | int) and not isinstance(value, bool):
        dtype = _NAMES.get(str(value).strip().lower().removeprefix("torch."))
    else:
        dtype = value
    allowed = _ALLOWED[key]
    if dtype in allowed:
        return dtype
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
    fp8 = " (fp8 state needs Transformer Engine's FusedAdam, which Ascend NPUs do not have)"
    raise ValueError(
        f"{key}={value!r}: the plugin's precision-aware Adam keeps {key} in {names} only"
        f"{fp8 if 'float8' in str(dtype) or 'fp8' in str(value).lower() else ''}; set one of them"
    )


@dataclasses.dataclass(frozen=True)
class AdamSettings:
    """The precision and placement of one Adam's state."""

    precision_aware: bool = False
    main_grads_dtype: torch.dtype = torch.float32
    main_params_dtype: torch.dtype = torch.float32
    exp_avg_dtype: torch.dtype = torch.float32
    exp_avg_sq_dtype: torch.dtype = torch.float32
    store_param_remainders: bool = True
    cpu_offload: bool = False
    offload_fraction: float = 0.0
    overlap_copies: bool = False

    @classmethod
    def from_keys(cls, keys: Mapping[str, Any]) -> AdamSettings:
        """Megatron's ``OptimizerConfig`` field names -> settings, every value checked."""
        precision_aware = _flag(keys, "use_precision_aware_optimizer")
        dtypes = {key: parse_dtype(key, keys.get(key, torch.float32)) for key in DTYPE_KEYS}
        if not precision_aware:
            for key, dtype in dtypes.items():
                if dtype != torch.float32:
                    raise ValueError(
                        f"{key}={keys[key]!r} needs use_precision_aware_optimizer=True (without "
                        "it the optimizer state and gradients are fp32, as in Megatron); set "
                        f"use_precision_aware_optimizer=True or {key}=fp32"
                    )
        return cls(
            precision_aware=precision_aware,
            **dtypes,
            store_param_remainders=_flag(keys, "store_param_remainders", True),
            cpu_offload=_flag(keys, "optimizer_cpu_offload"),
            offload_fraction=_fraction(keys.get("optimizer_offload_fraction", 0.0)),
            overlap_copies=_flag(keys, "overlap_cpu_optimizer_d2h_h2d"),
        )

    @property
    def needs_plugin_adam(self) -> bool:
        """True when Megatron cannot build this optimizer itself without TE."""
        return self.precision_aware or self.cpu_offload

    def check_against(self, *, optimizer: str, use_distributed_optimizer: bool) -> None:
        """The combinations Megatron's ``OptimizerConfig`` asserts, as ``ValueError`` lines."""
        if self.needs_plugin_adam and str(optimizer).lower() not in ("adam", "adamw"):
            raise ValueError(
                f"optimizer={optimizer!r} with use_precision_aware_optimizer / "
                "optimizer_cpu_offload: both are Adam-only (as in Megatron); set optimizer=adam "
                "or turn them off"
            )
        if self.precision_aware and not use_distributed_optimizer:
            raise ValueError(
                "use_precision_aware_optimizer=True with use_distributed_optimizer=False: "
                "Megatron's precision-aware optimizer works through the distributed optimizer; "
                "set use_distributed_optimizer=True"
            )


def _flag(keys: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = keys.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TypeError(f"{key}={value!r}: expected true or false")
    return value


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"optimizer_offload_fraction={value!r}: expected a number in [0, 1] (the share of "
            "the parameters whose optimizer state lives in host memory; 0 keeps it all on the "
            "device, as in Megatron)"
        )
    return float(value)
