"""Module-level NPU layer specs for Megatron-LM's ``--spec MODULE NAME``.

Megatron-LM's ``pretrain_gpt.py --spec mcore_npu.transformer.megatron_lm npu_layer_spec_qk_norm``
looks the object up with ``megatron.core.transformer.spec_utils.import_module``, which is
``vars(import_module(MODULE))[NAME]``: it reads a module-level object and does not call it. So
the specs are built here, once, when this module is first imported, by ``get_gpt_layer_npu_spec``
with its defaults (``kernel="auto"``: torch_npu on NPU tensors, the reference elsewhere;
``param_layout="te"``: the parameter names of Megatron-LM's default Transformer Engine spec, so
its checkpoints load):

| NAME | the layer | use it for |
|---|---|---|
| ``npu_layer_spec`` | dense | Llama, Qwen2.5 |
| ``npu_layer_spec_qk_norm`` | dense, RMSNorm on q and k | Qwen3 (``--qk-layernorm``) |
| ``npu_moe_layer_spec`` | MoE, grouped experts | Mixtral-like (``--num-experts N --moe-grouped-gemm``) |
| ``npu_moe_layer_spec_qk_norm`` | MoE, grouped experts, q/k norm | Qwen3-MoE |

The MoE specs carry ``TEGroupedMLP``'s names (what ``--moe-grouped-gemm`` gives with TE); the
expert count, top-k and the rest come from Megatron-LM's arguments (``TransformerConfig``).

What a layer spec cannot carry (Megatron-LM builds the rest of the block itself):

- every layer is built from the one spec: an MoE spec makes every layer MoE
  (``--moe-layer-freq`` patterns need ``get_gpt_decoder_block_npu_spec(config)``);
- the block's final norm is Megatron's ``LayerNormImpl`` (TENorm with Transformer Engine, else
  apex's FusedLayerNorm, which is LayerNorm only, else torch's), not the NPU spec's; for RMSNorm
  on a machine with apex, for sequence parallelism, or for the final norm's ``_extra_state`` of
  the TE key set, build the model from Python with ``get_gpt_decoder_block_npu_spec(config)``.

The four specs are shared by every model built from them in a process, and so is their attention's
cu_seqlens memo, which is keyed by tensor object (``mcore_npu.masks.SeqLengthsMemo``).
"""

from __future__ import annotations

from mcore_npu.transformer.layer_specs import get_gpt_layer_npu_spec

_MOE = {"num_experts": 8, "moe_grouped_gemm": True}  # any count: the config's num_moe_experts rules

npu_layer_spec = get_gpt_layer_npu_spec()
npu_layer_spec_qk_norm = get_gpt_layer_npu_spec(qk_layernorm=True)
npu_moe_layer_spec = get_gpt_layer_npu_spec(**_MOE)
npu_moe_layer_spec_qk_norm = get_gpt_layer_npu_spec(qk_layernorm=True, **_MOE)

SPECS = ("npu_layer_spec", "npu_layer_spec_qk_norm", "npu_moe_layer_spec",
         "npu_moe_layer_spec_qk_norm")  # fmt: skip
"""The names ``--spec mcore_npu.transformer.megatron_lm NAME`` takes."""
