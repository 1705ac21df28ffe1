"""verl's ``MegatronEngine._build_tf_config`` for mbridge (``vanilla_mbridge=True``), with the
bridge built by the plugin.

verl 0.9.1 builds the bridge inline with ``AutoBridge.from_config``, and mbridge builds the
Megatron config in the bridge's constructor, so a bridge whose config this stack cannot build
(DeepSeek-V3) or that mbridge lacks (Qwen3.5) cannot be fixed afterwards. For those models the
NPU engines run :func:`build_mbridge_tf_config`: verl's steps in verl's order, with verl's helpers,
the bridge from ``make_bridge``. Left out: verl's ``deepseek_v4`` context-parallel keys and its
rank-0 print. tests/integrations/test_deepseek_config.py checks verl's method against
``VERL_SOURCE_SHA256`` and that this function builds the config verl builds.
"""

from __future__ import annotations

import torch

VERL_SOURCE_SHA256 = "da38df1ef96a357ca925b2a1af83047dbf0082a0d04770273c9cd21c0ec15e7b"
"""sha256 of ``inspect.getsource(MegatronEngine._build_tf_config)`` in verl 0.9.1."""


def build_mbridge_tf_config(engine, make_bridge) -> None:
    """Set ``engine``'s attributes as verl 0.9.1's ``_build_tf_config`` does with mbridge.

    Args:
        engine: a verl ``MegatronEngine`` (its ``model_config``, ``engine_config``,
            ``enable_routing_replay`` as verl's ``__init__`` left them).
        make_bridge: ``(hf_config, dtype=...) -> bridge``, instead of ``AutoBridge.from_config``.

    Sets ``is_value_model``, ``share_embeddings_and_output_weights``, ``param_dtype``, ``dtype``,
    ``provider`` (None), ``vanilla_bridge`` (True), ``bridge``, ``tf_config`` and ``peft_cls``.
    """
    from verl.utils.megatron_utils import check_mtp_config, mapping_string_to_attn_backend
    from verl.utils.torch_dtypes import PrecisionType
    from verl.workers.config.megatron_peft import get_peft_cls

    model_config, engine_config = engine.model_config, engine.engine_config
    engine.is_value_model = model_config.model_type == "value_model"
    engine.share_embeddings_and_output_weights = model_config.share_embeddings_and_output_weights
    check_mtp_config(model_config, engine_config)
    engine.param_dtype = PrecisionType.to_dtype(engine_config.dtype)
    engine.dtype = PrecisionType.to_dtype(engine.param_dtype)
    overrides = mapping_string_to_attn_backend({**engine_config.override_transformer_config})
    if engine.is_value_model:  # a value head never shares the embedding (verl: on the HF config)
        model_config.hf_config.tie_word_embeddings = False
        engine.share_embeddings_and_output_weights = False
    overrides.update(_dynamic_context_parallel(engine_config))
    engine.provider, engine.vanilla_bridge = None, True

    bridge = make_bridge(model_config.hf_config, dtype=engine.param_dtype)
    bridge.set_extra_args(**overrides)
    tf_config = bridge.config
    tf_config.fp16 = engine.param_dtype == torch.float16
    tf_config.bf16 = engine.param_dtype == torch.bfloat16
    if engine.is_value_model and hasattr(tf_config, "share_embeddings_and_output_weights"):
        tf_config.share_embeddings_and_output_weights = False
    engine.bridge = bridge
    if engine.enable_routing_replay:  # on the built config, as verl sets it
        name = "moe_enable_routing_replay"
        setattr(tf_config, name if hasattr(tf_config, name) else "enable_routing_replay", True)
    engine.tf_config = tf_config
    engine.peft_cls = get_peft_cls(model_config=model_config, bridge=bridge, provider=None,
                                   dtype=engine.param_dtype)  # fmt: skip


def _dynamic_context_parallel(engine_config) -> dict:
    """The overrides verl adds for dynamic context parallelism ({} without it)."""
    if not engine_config.dynamic_context_parallel:
        return {}
    return {
        "calculate_per_token_loss": True,
        "context_parallel_size": engine_config.context_parallel_size,
        "dynamic_context_parallel": False,  # verl runs the MCore scheduler before the pipeline
        "max_seqlen_per_dp_cp_rank": engine_config.max_seqlen_per_dp_cp_rank,
    }
