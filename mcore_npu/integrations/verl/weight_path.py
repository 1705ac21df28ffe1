"""Which bridge builds the model: verl's ``vanilla_mbridge`` and what the NPU engines do with it.

``True``: mbridge (or the plugin's bridge where mbridge's cannot build the config). ``False`` with
an importable ``megatron.bridge``: Megatron-Bridge, the NPU spec on the provider and
:func:`megatron_bridge_overrides` in the overrides. ``False`` without it (every release imports
Transformer Engine): a family the plugin's Hugging Face path covers (:func:`uncovered_reason` is
None) builds as with ``True`` on the engine's own config copy, with one warning line
(:func:`mbridge_fallback`); any other family, and verl's QAT, is refused in one line. Actor,
reference model and critic each decide for themselves. See docs/weight_path.md.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# the plugin's module classes -> Megatron-Bridge's AutoMapping parallelism type (it finds a
# weight's tensor-parallel split by the class name of the module holding it)
MEGATRON_BRIDGE_MODULE_TYPES = {
    "NPUTopKRouter": "replicated",
    "NPUGroupedColumnLinear": "column",  # the grouped experts' fc1
    "NPUGroupedRowLinear": "row",  # fc2
}

__all__ = [
    "MEGATRON_BRIDGE_MODULE_TYPES",
    "megatron_bridge_import_error",
    "register_npu_modules",
    "megatron_bridge_overrides",
    "megatron_bridge_unavailable",
    "mbridge_fallback",
    "refuse_without_bridge",
    "uncovered_reason",
]


def megatron_bridge_import_error() -> ImportError | None:
    """The ``ImportError`` of ``import megatron.bridge``, or None when it imports."""
    try:
        import megatron.bridge  # noqa: F401
    except ImportError as error:
        return error
    return None


def uncovered_reason(hf_config) -> str | None:
    """Why the plugin's Hugging Face path cannot build this model, or None when it can.

    Covered (what ``vanilla_mbridge=True`` builds): the plugin's own bridges (``PLUGIN_BRIDGES``,
    hub form included), and a language model (no ``vision_config``) with a bridge in mbridge's
    registry or ``FIXED_BRIDGES``.
    """
    from mcore_npu.integrations.hf import PLUGIN_BRIDGES
    from mcore_npu.integrations.mbridge_fixes import FIXED_BRIDGES

    model_type = getattr(hf_config, "model_type", None)
    if model_type in PLUGIN_BRIDGES:
        return None
    if getattr(hf_config, "vision_config", None) is not None:
        return (
            f"model_type {model_type!r} has a vision tower, and the plugin's Hugging Face path "
            "builds language models (GPTModel) only"
        )
    if model_type in FIXED_BRIDGES:
        return None
    try:
        from mbridge import AutoBridge
    except ImportError as error:
        return f"mbridge is not importable either ({error})"
    supported = AutoBridge.list_supported_models()
    if model_type not in supported:
        known = ", ".join(sorted({*supported, *FIXED_BRIDGES, *PLUGIN_BRIDGES}))
        return f"model_type {model_type!r} has no mbridge or plugin bridge (those: {known})"
    return None


def megatron_bridge_overrides(hf_config) -> dict:
    """Provider fields for Megatron-Bridge's ``GPTModelProvider`` with the NPU spec, which go
    into the engine's copy of ``override_transformer_config`` (verl sets them before
    ``provider.finalize()``): ``moe_permute_fusion=False`` (else an ``ImportError`` without TE),
    the Hugging Face router's ``moe_router_pre_softmax`` (MoE only) and
    ``attention_backend="auto"``. Why each: docs/weight_path.md."""
    from mcore_npu.integrations.hf import hf_router_pre_softmax

    overrides: dict = {"moe_permute_fusion": False, "attention_backend": "auto"}
    pre_softmax = hf_router_pre_softmax(hf_config)
    if pre_softmax is not None:
        overrides["moe_router_pre_softmax"] = pre_softmax
    return overrides


def register_npu_modules() -> None:
    """Register :data:`MEGATRON_BRIDGE_MODULE_TYPES` with ``AutoMapping.register_module_type``
    (without it a Qwen3-MoE load stops: "Cannot determine parallelism type"). Idempotent."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    for name, parallelism in MEGATRON_BRIDGE_MODULE_TYPES.items():
        AutoMapping.register_module_type(name, parallelism)


def refuse_without_bridge(engine_config) -> None:
    """Refuse ``use_mbridge=False`` (``ValueError``, one line) before verl's
    ``MegatronEngine.__init__`` asserts on it: verl 0.9.1 builds every model through a bridge,
    but older recipes (GKD, verl's older Qwen3-MoE sglang script) still set it."""
    if getattr(engine_config, "use_mbridge", True):
        return
    raise ValueError(
        f"engine_config.use_mbridge={engine_config.use_mbridge!r}: verl 0.9.1's Megatron engine "
        "builds every model through a bridge and asserts use_mbridge (the pre-bridge loader of "
        "older verl is gone); set megatron.use_mbridge=True (actor and ref: the same Hugging "
        "Face weights, and use_dist_checkpointing still loads a Megatron checkpoint)."
    )


def mbridge_fallback(engine_config, hf_config) -> bool:
    """Whether this engine builds through mbridge although ``vanilla_mbridge=False``: True (and
    one warning line) when ``megatron.bridge`` does not import and the plugin covers the model.

    Raises ``ValueError`` when it does not import and the model is not covered
    (:func:`uncovered_reason`) or verl's QAT is on.
    """
    if engine_config.vanilla_mbridge:
        return False
    error = megatron_bridge_import_error()
    if error is None:
        return False
    reason = uncovered_reason(hf_config)
    qat = getattr(engine_config, "qat", None)
    if reason is None and getattr(qat, "enable", False):
        reason = "qat.enable=True, and verl builds QAT through Megatron-Bridge only"
    if reason is not None:
        raise ValueError(megatron_bridge_unavailable(error, reason)) from error
    logger.warning(
        "mcore_npu: vanilla_mbridge=False selects Megatron-Bridge, but `import megatron.bridge` "
        "fails (%s: %s); building %r through mbridge instead, as with vanilla_mbridge=True "
        "(the same parameter names, weights and exports)",
        type(error).__name__,
        error,
        getattr(hf_config, "model_type", None),
    )
    return True


def megatron_bridge_unavailable(error: ImportError, uncovered: str | None = None) -> str:
    """The one-line reason and remedy for a failed ``import megatron.bridge``; ``uncovered``:
    why the mbridge fallback cannot build this model either (None: not asked)."""
    missing = error.name or ""
    if missing.startswith("transformer_engine"):
        why = (
            "Megatron-Bridge imports transformer_engine as soon as megatron.bridge is imported "
            "(megatron/bridge/peft/lora_layers.py), and Transformer Engine has no Ascend build"
        )
    elif missing == "megatron" or missing.startswith("megatron.bridge"):
        why = "the megatron-bridge package is not installed"
    else:
        why = f"megatron.bridge needs {missing or 'a module'} that is not importable"
    fallback = "" if uncovered is None else f"; the mbridge fallback cannot build it: {uncovered}"
    return (
        "engine_config.vanilla_mbridge=False selects Megatron-Bridge, but `import megatron.bridge` "
        f"fails ({type(error).__name__}: {error}): {why}{fallback}. Install a Megatron-Bridge "
        "that imports here, or use a model family mbridge builds (see docs/weight_path.md)."
    )
