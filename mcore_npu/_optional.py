"""The one place that imports the Ascend packages (``torch_npu``, ``fla_npu``, ``fla``,
``flash_attn_npu``), at call time, never at import of the plugin."""

from __future__ import annotations

import importlib

FIXES = {
    "torch_npu": (
        "on an Ascend machine, source CANN first (source /usr/local/Ascend/ascend-toolkit/"
        "set_env.sh) and install the torch-npu build that matches your torch exactly (torch "
        "2.6.0 -> torch-npu 2.6.0.postN, ...); elsewhere use kernel='reference' or 'auto'"
    ),
    "fla_npu": "pip install flash-linear-attention-npu on the Ascend machine, or use 'auto'",
    "flash_attn_npu": (
        "pip install flash-attention-npu on the Ascend machine (batch-invariant mode's attention)"
    ),
    "batch_invariant_ops": (
        "build vllm-ascend with VLLM_BATCH_INVARIANT=1 on the Ascend machine (it installs the "
        "batch-invariant operator library; batch-invariant mode's matmuls and sums)"
    ),
    "fla": "pip install flash-linear-attention (with triton-ascend) on the Ascend machine",
    "mamba_ssm": "pip install a triton-ascend build of mamba-ssm on the Ascend machine, or use 'auto'",
}


def import_optional(name: str):
    """The module ``name``, or None when it does not import (any exception: a broken CANN too)."""
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def load(name: str):
    """The module ``name`` now, or an ImportError that says why and how to fix it."""
    try:
        return importlib.import_module(name)
    except Exception as err:  # ImportError, OSError and RuntimeError all occur without CANN
        package = name.split(".")[0]
        fix = FIXES.get(package, f"install {package}")
        raise ImportError(
            f"{package}: failed to import ({type(err).__name__}: {err})\n  fix: {fix}"
        ) from err
