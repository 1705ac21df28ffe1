"""The transformer room: what fills Megatron-Core's spec slots, and the spec builders.

- :mod:`~mcore_npu.transformer.attention`: ``NPUFusionAttention``, the core-attention slot.
- :mod:`~mcore_npu.transformer.norms`: LayerNorm / RMSNorm (``npu_rms_norm``) that work under
  sequence parallelism.
- :mod:`~mcore_npu.transformer.mlp`: ``NPUMLP`` / ``NPUSharedExpertMLP`` (SwiGLU via ``npu_swiglu``).
- :mod:`~mcore_npu.transformer.router`: ``NPUTopKRouter`` (MoE gating without Transformer Engine).
- :mod:`~mcore_npu.transformer.experts`: ``NPUGroupedMLP`` (experts via ``npu_grouped_matmul``).
- :mod:`~mcore_npu.transformer.layer_specs`: ``get_gpt_layer_npu_spec``,
  ``get_gpt_decoder_block_npu_spec``, ``get_gpt_layer_spec``.
- :mod:`~mcore_npu.transformer.backends`: which backend ``"auto"`` means on this machine.

Built on :mod:`mcore_npu.masks` and :mod:`mcore_npu.ops`; imports Megatron-Core in its modules,
never in this ``__init__``. Nothing here patches Megatron, keeps global state or writes ``config``.
"""
