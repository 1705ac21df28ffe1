"""Module-level NPU layer specs for Megatron-LM's ``--spec mcore_npu.transformer.megatron_lm NAME``.

Megatron-LM reads a module-level object (``spec_utils.import_module``) and does not call it, so the
specs are built once, at import, by ``get_gpt_layer_npu_spec`` with its defaults (``"te"`` names, so
Megatron-LM's checkpoints load): ``npu_layer_spec`` (dense), ``npu_layer_spec_qk_norm`` (q/k
RMSNorm), ``npu_moe_layer_spec`` and ``npu_moe_layer_spec_qk_norm`` (MoE, grouped experts' names).
They are shared by every model built from them in a process, and so is their cu_seqlens memo. What a
layer spec cannot carry (layer patterns, the final norm): docs/specs.md."""

from __future__ import annotations

from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec

_MOE = {"num_experts": 8, "moe_grouped_gemm": True}  # any count: the config's num_moe_experts rules

npu_layer_spec = get_gpt_layer_npu_spec()
npu_layer_spec_qk_norm = get_gpt_layer_npu_spec(qk_layernorm=True)
npu_moe_layer_spec = get_gpt_layer_npu_spec(**_MOE)
npu_moe_layer_spec_qk_norm = get_gpt_layer_npu_spec(qk_layernorm=True, **_MOE)

SPECS = (
    "npu_layer_spec",
    "npu_layer_spec_qk_norm",
    "npu_moe_layer_spec",
    "npu_moe_layer_spec_qk_norm",
)
"""The names ``--spec mcore_npu.transformer.megatron_lm NAME`` takes."""
