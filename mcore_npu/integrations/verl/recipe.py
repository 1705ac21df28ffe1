"""verl's ``override_transformer_config`` through the recipe vocabulary, for the NPU engines.

MindSpeed-style keys raise in ``TransformerConfig(**kwargs)``. :func:`apply_recipe` translates
the dict (:func:`mcore_npu.transformer.recipe_keys.translate`) before verl reads it, into an engine
config for this engine alone (a ``dataclasses.replace`` copy holding only Megatron fields and the
recipe's ``use_distributed_optimizer``) and the NPU spec keywords; a refused key raises
``ValueError`` (one line) before any bridge or model exists. See docs/mindspeed.md.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

from mcore_npu.transformer.recipe_keys import RecipeContext, RecipePlan, translate

logger = logging.getLogger(__name__)

__all__ = ["apply_recipe", "has_gated_delta_net", "recipe_context"]

LINEAR_ATTENTION = "linear_attention"
"""transformers' ``layer_types`` entry of a gated-delta-net layer (Qwen3.5, Qwen3-Next)."""


def has_gated_delta_net(hf_config) -> bool:
    """Whether the (text) config's ``layer_types`` names a ``linear_attention`` layer."""
    text = getattr(hf_config, "text_config", None) or hf_config
    return LINEAR_ATTENTION in (getattr(text, "layer_types", None) or ())


def _config_class(hf_config) -> type:
    """``MLATransformerConfig`` for MLA models (``kv_lora_rank``), else ``TransformerConfig``."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    text = getattr(hf_config, "text_config", None) or hf_config
    return MLATransformerConfig if getattr(text, "kv_lora_rank", None) else TransformerConfig


def recipe_context(
    engine_config, hf_config, *, vanilla_mbridge: bool | None = None
) -> RecipeContext:
    """verl's side of the run: the sizes and switches verl itself gives Megatron.

    Sequence parallelism: mbridge sets it to ``TP > 1``; Megatron-Bridge takes
    ``engine_config.sequence_parallel``. ``vanilla_mbridge``: the bridge the engine will use,
    when not the config's (the fallback of :mod:`.weight_path`).
    """
    text = getattr(hf_config, "text_config", None) or hf_config
    tp = engine_config.tensor_model_parallel_size
    vanilla = engine_config.vanilla_mbridge if vanilla_mbridge is None else vanilla_mbridge
    return RecipeContext(
        config_class=_config_class(hf_config),
        num_layers=int(getattr(text, "num_hidden_layers", 0) or 0),
        tensor_parallel_size=tp,
        pipeline_parallel_size=engine_config.pipeline_model_parallel_size,
        context_parallel_size=engine_config.context_parallel_size,
        virtual_pipeline_size=engine_config.virtual_pipeline_model_parallel_size,
        sequence_parallel=tp > 1 if vanilla else bool(engine_config.sequence_parallel),
        use_distributed_optimizer=engine_config.use_distributed_optimizer,
        gated_delta_net=has_gated_delta_net(hf_config),
    )


def apply_recipe(
    engine_config, hf_config, *, mbridge_fallback: bool = False, provider: dict | None = None
) -> tuple[object, dict, RecipePlan]:
    """``(engine config for verl, NPU spec keywords, the plan)``; logs the plan's lines.

    ``mbridge_fallback``: the copy also gets ``vanilla_mbridge=True`` (verl's deprecation warning
    for it is not shown). ``provider``: Megatron-Bridge provider fields put under the translated
    overrides. A refused recipe key raises ``ValueError``.
    """
    vanilla = True if mbridge_fallback else None
    context = recipe_context(engine_config, hf_config, vanilla_mbridge=vanilla)
    plan = translate(engine_config.override_transformer_config, context)
    for line in plan.log:
        logger.info("mcore_npu recipe: %s", line)
    fields = {"vanilla_mbridge": True} if mbridge_fallback else {}
    with warnings.catch_warnings():
        if mbridge_fallback:  # verl's McoreEngineConfig.__post_init__: "... is deprecated"
            warnings.filterwarnings("ignore", "The legacy mbridge backend", FutureWarning)
        config = dataclasses.replace(
            engine_config,
            override_transformer_config={**(provider or {}), **plan.megatron},
            **plan.optimizer,
            **fields,
        )
    return config, dict(plan.spec), plan
