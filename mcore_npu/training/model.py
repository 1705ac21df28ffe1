"""Config -> Megatron ``TransformerConfig`` + layer spec -> ``GPTModel``, or Megatron's hybrid
model for ``model.hybrid_pattern`` (``build_model(cfg)``, once Megatron's parallel state exists)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_npu.allocator import device
from mcore_npu.transformer.backends import resolve_backend
from mcore_npu.transformer.layer_specs import (
    get_gpt_decoder_block_npu_spec,
    get_gpt_mtp_block_npu_spec,
)

_ACTIVATIONS = {  # name -> (activation_func, gated_linear_unit)
    "swiglu": (F.silu, True),
    "gelu": (F.gelu, False),
    "relu": (F.relu, False),
}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_config(cfg):
    """Megatron ``TransformerConfig`` from the ``model``, ``parallel`` and ``train`` sections
    (``MLATransformerConfig`` for MLA, ``GDNTransformerConfig`` for Gated DeltaNet)."""
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    from mcore_npu.training.config import is_gdn, is_mla

    m, p, t = cfg.model, cfg.parallel, cfg.train
    fields = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size or _default_ffn(m.hidden_size, m.activation),
        normalization=m.normalization,
        qk_layernorm=m.qk_layernorm,
        add_bias_linear=m.add_bias_linear,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        window_size=tuple(m.window_size) if m.window_size is not None else None,
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        context_parallel_size=p.context,
        expert_model_parallel_size=p.expert,
        expert_tensor_parallel_size=p.expert_tensor,
        cp_comm_type=p.cp_comm_type if p.context > 1 else None,
        sequence_parallel=p.sequence_parallel,
        params_dtype=_DTYPES[t.dtype],
        pipeline_dtype=_DTYPES[t.dtype],
        bf16=t.dtype == "bf16",
        fp16=t.dtype == "fp16",
        **_activation_fields(m.activation),
        **_portable_fields(),
        **_stage_fields(p, m.num_layers),
    )
    fields.update(_plain(m.extra))
    if m.hybrid_pattern is not None:
        fields["is_hybrid_model"] = True  # Megatron's output-layer init for hybrids
    if resolve_backend(cfg.attention.backend) == "npu_fusion":
        fields["apply_rope_fusion"] = False  # the intent is in rope_kernel (Megatron's is TE-only)
    if is_mla(cfg):
        from mcore_npu.transformer.dsa import DSATransformerConfig, is_dsa

        rope = dict(rotary_base=float(m.rotary_base), rotary_percent=float(m.rotary_percent))
        config_class = DSATransformerConfig if is_dsa(fields) else MLATransformerConfig
        return config_class(**fields, **rope)  # an MLA layer builds its own RoPE
    if is_gdn(cfg):  # Megatron's own config asserts CP == 1 for GDN
        from mcore_npu.transformer.gated_delta_net import GDNTransformerConfig

        return GDNTransformerConfig(**fields)
    return TransformerConfig(**fields)


def _plain(extra) -> dict:
    """``model.extra`` as plain Python values (Megatron checks ``isinstance(value, list)``)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(extra) if OmegaConf.is_config(extra) else dict(extra)


def rope_kernel(cfg) -> str | None:
    """The spec's ``rope_kernel``: ``fused.rope``; when that is off, ``model.extra``'s
    ``apply_rope_fusion: true`` (Megatron's spelling) asks for it with ``attention.kernel``."""
    value = cfg.fused.rope
    if value == "off" and bool(dict(cfg.model.extra).get("apply_rope_fusion", False)):
        return None
    return value


def _stage_fields(p, num_layers: int) -> dict:
    """Uneven pipeline stages as Megatron's keys; {} if even."""
    from omegaconf import OmegaConf

    from mcore_npu.transformer.pipeline_layout import resolve_stage_keys

    first, last = p.get("first_stage_layers"), p.get("last_stage_layers")
    per_stage = p.get("pipeline_num_transformer_layers")
    if per_stage is None and first is None and last is None:
        return {}
    if OmegaConf.is_config(per_stage):
        per_stage = OmegaConf.to_container(per_stage)
    sizes = dict(num_layers=num_layers, pipeline_size=p.pipeline)
    return resolve_stage_keys(per_stage, **sizes, first=first, last=last)


def _default_ffn(hidden: int, activation: str) -> int:
    if activation != "swiglu":
        return 4 * hidden
    return 64 * -(-(8 * hidden // 3) // 64)  # 8/3 * hidden rounded up to a multiple of 64


def _activation_fields(name: str) -> dict:
    if name == "squared_relu":
        from megatron.core.activations import squared_relu

        return {"activation_func": squared_relu, "gated_linear_unit": False}
    func, gated = _ACTIVATIONS[name]
    return {"activation_func": func, "gated_linear_unit": gated}


def _portable_fields() -> dict:
    """Settings that run on every device: no apex/TE fusions, CPU-side init on a CPU."""
    on_cpu = device.current_accelerator() == "cpu"
    return dict(
        use_cpu_initialization=on_cpu,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        batch_p2p_comm=False,  # gloo has no batched isend/irecv
    )


def attention_choice(cfg, device) -> tuple[str, str | None]:
    """``(backend, kernel)`` the model's attention uses on ``device`` (kernel: npu_fusion only)."""
    from mcore_npu.ops import registry

    backend = resolve_backend(cfg.attention.backend)
    if backend != "npu_fusion":
        return backend, None
    return backend, registry.resolve("fusion_attention", cfg.attention.kernel, device).kernel


def layer_spec(cfg, config):
    """The decoder-block spec for ``attention.backend`` (auto resolved on this machine)."""
    backend = resolve_backend(cfg.attention.backend)
    if backend == "npu_fusion":
        return get_gpt_decoder_block_npu_spec(
            config,
            kernel=cfg.attention.kernel,
            param_layout=cfg.model.param_layout,
            normalization=cfg.model.normalization,
            rms_norm_kernel=cfg.fused.rms_norm,
            swiglu_kernel=cfg.fused.swiglu,
            grouped_matmul_kernel=cfg.fused.grouped_matmul,
            moe_permute_kernel=cfg.fused.moe_permute,
            rope_kernel=rope_kernel(cfg),
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(
        config, use_transformer_engine=backend == "te", normalization=cfg.model.normalization
    )


def mtp_spec(cfg, config, block):
    """The multi-token-prediction block for ``model.mtp_num_layers`` (None: no MTP layers)."""
    if not config.mtp_num_layers:
        return None
    if config.mtp_loss_scaling_factor is None:  # megatron-core 0.15's default; 0.16+: 0.1
        raise ValueError(
            f"model.mtp_num_layers={config.mtp_num_layers}: the installed megatron-core's "
            "TransformerConfig leaves mtp_loss_scaling_factor None, which its MTP loss divides "
            "(megatron-core 0.16+ defaults it to 0.1); set model.mtp_loss_scaling_factor"
        )
    backend = resolve_backend(cfg.attention.backend)
    if backend == "npu_fusion":
        return get_gpt_mtp_block_npu_spec(
            config,
            block,
            kernel=cfg.attention.kernel,
            param_layout=cfg.model.param_layout,
            rms_norm_kernel=cfg.fused.rms_norm,
        )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    return get_gpt_mtp_block_spec(config, block, use_transformer_engine=backend == "te")


def build_model(cfg, config=None, *, pre_process=None, post_process=None):
    """This pipeline stage's ``GPTModel`` (in a ``Float16Module`` for bf16/fp16), MTP included;
    ``config`` defaults to ``transformer_config(cfg)``, the stages to Megatron's pipeline state."""
    from megatron.core import parallel_state

    config = config or transformer_config(cfg)
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    if cfg.model.hybrid_pattern is not None:
        model = hybrid_model(cfg, config, pre_process=pre_process, post_process=post_process)
    else:
        model = _gpt_model(cfg, config, pre_process, post_process)
    if config.bf16 or config.fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def _gpt_model(cfg, config, pre_process: bool, post_process: bool):
    from megatron.core.models.gpt import GPTModel

    block = layer_spec(cfg, config)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        mtp_block_spec=mtp_spec(cfg, config, block),
        **_language_model_args(cfg, pre_process, post_process),
    )


def _language_model_args(cfg, pre_process: bool, post_process: bool) -> dict:
    """What GPTModel and the hybrid model classes take alike, from the ``model`` section."""
    m = cfg.model
    return dict(
        vocab_size=m.vocab_size,
        max_sequence_length=m.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=m.share_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
        rotary_percent=float(m.rotary_percent),
    )


def hybrid_model(cfg, config, *, pre_process: bool, post_process: bool):
    """Megatron's hybrid model (``HybridModel`` 0.18+, ``MambaModel`` before) for
    ``model.hybrid_pattern``, its stack from ``get_hybrid_stack_npu_spec``."""
    from mcore_npu.transformer.mamba.spec import get_hybrid_stack_npu_spec
    from mcore_npu.transformer.mamba.stack import hybrid_model_class

    m = cfg.model
    spec = get_hybrid_stack_npu_spec(
        kernel=cfg.attention.kernel,
        rms_norm_kernel=cfg.fused.rms_norm,
        swiglu_kernel=cfg.fused.swiglu,
        grouped_matmul_kernel=cfg.fused.grouped_matmul,
        moe_permute_kernel=cfg.fused.moe_permute,
        rope_kernel=rope_kernel(cfg),
        qk_layernorm=m.qk_layernorm,
        num_experts=m.extra.get("num_moe_experts"),
    )
    model_class, spec_key, pattern_key = hybrid_model_class()
    args = _language_model_args(cfg, pre_process, post_process)
    return model_class(config, **{spec_key: spec, pattern_key: m.hybrid_pattern}, **args)
