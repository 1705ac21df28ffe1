"""Which bridge builds the model: verl's ``vanilla_mbridge`` and what the NPU engines do with it.

verl 0.9.1's ``McoreEngineConfig.vanilla_mbridge`` (default ``False``) picks the bridge that maps
Hugging Face checkpoints onto Megatron:

- ``True``: mbridge (``verl/models/mcore/mbridge.py``); the NPU engines build through it, or
  through the plugin's bridge where mbridge's cannot build its config on this stack
  (:mod:`mcore_npu.integrations.mbridge_fixes`, DeepSeek-V3).
- ``False`` and ``import megatron.bridge`` succeeds: Megatron-Bridge, as verl does it, with the
  NPU spec on the provider and :func:`megatron_bridge_overrides` in the engine's copy of
  ``override_transformer_config`` (verl sets those on the provider before ``finalize()``).
- ``False`` and the import fails (every Megatron-Bridge release imports Transformer Engine, which
  Ascend NPUs do not have): for a model family the plugin's Hugging Face path covers
  (:func:`uncovered_reason` is None) the engine builds exactly as with ``vanilla_mbridge=True``:
  :func:`mbridge_fallback` says so, and the engine's own copy of its engine config (the recipe's
  ``dataclasses.replace``, :func:`mcore_npu.integrations.verl.recipe.apply_recipe`) carries
  ``vanilla_mbridge=True``. One warning line is logged per engine (actor, reference, critic);
  the user's config object is not changed. Any other family, and verl's QAT (which only
  Megatron-Bridge builds), is refused with one ``ValueError`` line.

The reference model's ``ref.megatron.vanilla_mbridge`` follows the actor's (verl's
``megatron_ref.yaml``: ``${oc.select:actor_rollout_ref.actor.megatron.vanilla_mbridge,False}``)
and the critic has its own ``critic.megatron.vanilla_mbridge``; all three are built by a
``TrainingWorker`` whose engine is one of the NPU engines, so all three take this path.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# the plugin's module classes -> Megatron-Bridge's AutoMapping parallelism type (it finds a
# weight's tensor-parallel split by the class name of the module holding it)
MEGATRON_BRIDGE_MODULE_TYPES = {
    "NPUTopKRouter": "replicated",  # mcore_npu.transformer.router (a TopKRouter)
    "NPUGroupedColumnLinear": "column",  # mcore_npu.transformer.experts: fc1, TE layout
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

    Covered: a language model (no ``vision_config``) whose ``model_type`` has a bridge in
    mbridge's registry (``AutoBridge.list_supported_models()``) or in the plugin's
    (``mbridge_fixes.FIXED_BRIDGES``), and the Gated DeltaNet hybrids the plugin bridges itself
    (``mbridge_fixes.PLUGIN_BRIDGES``: Qwen3.5 dense and MoE, Qwen3-Next), the hub form of Qwen3.5 included
    (its bridge builds and trains the language model and logs that the vision tower is not
    trained). These are the models ``vanilla_mbridge=True`` builds.
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
    """Provider fields for Megatron-Bridge's ``GPTModelProvider`` with the NPU spec.

    verl 0.9.1 applies ``override_transformer_config`` to the provider (``setattr``) before
    ``provider.finalize()`` runs Megatron's ``TransformerConfig`` checks, so these go into the
    engine's copy of it (a value the recipe's own translation produced wins):

    - ``moe_permute_fusion=False``: Megatron-Bridge's Qwen3-MoE bridge sets it True, and
      megatron-core 0.16.1's check then imports ``fused_permute``, which exists only with
      Transformer Engine (``transformer_config.py``: ``ImportError``). Megatron's field names
      TE's kernel; the NPU spec's permute kernel is its own spec keyword (the recipe's
      ``moe_permute_kernel``), so nothing the NPU model runs changes.
    - ``moe_router_pre_softmax``: the Hugging Face router's softmax form
      (:func:`mcore_npu.integrations.hf.hf_router_pre_softmax`); Megatron-Bridge, like mbridge,
      fixes ``False`` for Qwen3-MoE whatever ``norm_topk_prob`` says. Dense models: not set.
    - ``attention_backend="auto"``: verl sets ``flash`` on this path and mbridge keeps ``auto``;
      Megatron's GPTModel writes TE's ``NVTE_*`` variables from it and asserts that every model
      of a process agrees, while the NPU spec runs ``NPUFusionAttention`` whatever it says (the
      recipe vocabulary ignores the key for that reason).
    """
    from mcore_npu.integrations.hf import hf_router_pre_softmax

    overrides: dict = {"moe_permute_fusion": False, "attention_backend": "auto"}
    pre_softmax = hf_router_pre_softmax(hf_config)
    if pre_softmax is not None:
        overrides["moe_router_pre_softmax"] = pre_softmax
    return overrides


def register_npu_modules() -> None:
    """Make the plugin's router and grouped-expert classes known to Megatron-Bridge's
    ``AutoMapping`` through its own registration hook (``AutoMapping.register_module_type``,
    ``megatron/bridge/models/conversion/param_mapping.py``); without it loading a Qwen3-MoE
    stops with "Cannot determine parallelism type for module 'NPUTopKRouter'". Idempotent (the
    registry is a set per type); needs ``megatron.bridge`` importable."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    for name, parallelism in MEGATRON_BRIDGE_MODULE_TYPES.items():
        AutoMapping.register_module_type(name, parallelism)


def refuse_without_bridge(engine_config) -> None:
    """Refuse ``use_mbridge=False`` in one line, before verl's engine asserts on it.

    verl 0.9.1's ``MegatronEngine.__init__`` starts with ``assert self.engine_config.use_mbridge,
    "use_mbridge must be True"`` (``verl/workers/engine/megatron/transformer_impl.py:191``): its
    engines build every model through a bridge, and the pre-bridge loader that
    ``use_mbridge=False`` selected in older verl is gone. Recipes written for those (the GKD
    recipe, verl's older Qwen3-MoE sglang script) still set it.

    Raises:
        ValueError: ``engine_config.use_mbridge`` is false.
    """
    if getattr(engine_config, "use_mbridge", True):
        return
    raise ValueError(
        f"engine_config.use_mbridge={engine_config.use_mbridge!r}: verl 0.9.1's Megatron engine "
        "builds every model through a bridge and asserts use_mbridge (the pre-bridge loader of "
        "older verl is gone); set megatron.use_mbridge=True (actor and ref: the same Hugging "
        "Face weights, and use_dist_checkpointing still loads a Megatron checkpoint)."
    )


def mbridge_fallback(engine_config, hf_config) -> bool:
    """Whether this engine builds through mbridge although ``vanilla_mbridge=False``.

    True when Megatron-Bridge does not import and the plugin's path covers the model (logs one
    warning naming the fallback and why); False for ``vanilla_mbridge=True`` and when
    ``megatron.bridge`` imports (verl's Megatron-Bridge path then runs).

    Raises:
        ValueError: Megatron-Bridge does not import and the model is not covered
            (:func:`uncovered_reason`), or verl's QAT is on (it needs Megatron-Bridge).
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
    """The one-line reason and remedy for a failed ``import megatron.bridge``.

    ``uncovered``: why the mbridge fallback cannot build this model either (None: not asked).
    """
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
