"""Which attention backend a run uses, decided without importing megatron-core: ``auto`` is
npu_fusion where an NPU is usable, Transformer Engine where it imports, else Megatron's local spec.
An explicit ``te`` is checked here, before any process group starts."""

from __future__ import annotations

import importlib
import importlib.util

from mcore_npu.allocator import device

BACKENDS = ("auto", "npu_fusion", "local", "te")
PARAM_LAYOUTS = ("te", "local")  # npu_fusion parameter names: Transformer Engine spec | local spec


def check_param_layout(param_layout: str) -> str:
    """``param_layout`` itself, or ValueError naming it and the layouts there are."""
    if param_layout not in PARAM_LAYOUTS:
        raise ValueError(
            f"param_layout: unknown layout {param_layout!r}; pass one of {', '.join(PARAM_LAYOUTS)}"
        )
    return param_layout


def resolve_backend(backend: str) -> str:
    """``"auto"`` -> the backend this machine supports; an explicit choice is checked.

    Raises:
        ValueError: an unknown name.
        ImportError: ``"te"`` where transformer-engine does not import (with the cause).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r}; pass one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if device.is_npu_available():
            return "npu_fusion"
        return "te" if transformer_engine_error() is None else "local"
    if backend == "te":
        error = transformer_engine_error()
        if error is not None:
            raise ImportError(
                f"backend 'te' needs transformer-engine, which failed to import ({error}); install "
                "it on a CUDA machine (pip install 'mcore-npu[te]'), or use backend 'npu_fusion' "
                "or 'local'"
            )
    return backend


def transformer_engine_error() -> str | None:
    """None when transformer_engine.pytorch imports, else why not."""
    try:
        if importlib.util.find_spec("transformer_engine") is None:
            return "not installed"
        importlib.import_module("transformer_engine.pytorch")
    except Exception as err:  # a broken TE raises RuntimeError/OSError, not just ImportError
        return f"{type(err).__name__}: {err}"
    return None
