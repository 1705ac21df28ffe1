"""The transformer room: what fills Megatron-Core's spec slots, and the spec builders.

- :mod:`~mcore_npu.transformer.attention`: ``NPUFusionAttention``, the core-attention slot.
- :mod:`~mcore_npu.transformer.norms`: LayerNorm / RMSNorm that work under sequence parallelism.
- :mod:`~mcore_npu.transformer.norm_linear`: ``NormColumnParallelLinear``, the norm fused into
  ``linear_qkv`` / ``linear_fc1`` with TE's names (``layer_norm_weight``).
- :mod:`~mcore_npu.transformer.extra_state`: empty ``_extra_state`` entries where TE has them.
- :mod:`~mcore_npu.transformer.param_layout`: one tensor's names in the te and local layouts.
- :mod:`~mcore_npu.transformer.layer_specs`: ``get_gpt_layer_npu_spec``,
  ``get_gpt_decoder_block_npu_spec``, ``get_gpt_layer_spec``.
- :mod:`~mcore_npu.transformer.backends`: which backend ``"auto"`` means on this machine.

Built on :mod:`mcore_npu.masks` and :mod:`mcore_npu.ops`; imports Megatron-Core in its modules,
never in this ``__init__``. Nothing here patches Megatron, keeps global state or writes ``config``.
"""
