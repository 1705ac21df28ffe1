"""The transformer room: what fills Megatron-Core's spec slots, and the spec builders.

- :mod:`~mcore_npu.transformer.attention`: ``NPUFusionAttention``, the core-attention slot.
- :mod:`~mcore_npu.transformer.norms`: LayerNorm / RMSNorm (``npu_rms_norm``) that work under
  sequence parallelism.
- :mod:`~mcore_npu.transformer.mlp`: ``NPUMLP`` / ``NPUSharedExpertMLP`` (SwiGLU via ``npu_swiglu``).
- :mod:`~mcore_npu.transformer.rope`: ``NPURotarySelfAttention`` (RoPE via ``npu_rotary_mul`` after
  the q/k norms; ``rope_kernel``).
- :mod:`~mcore_npu.transformer.router`: ``NPUTopKRouter`` (MoE gating without Transformer Engine).
- :mod:`~mcore_npu.transformer.experts`: ``NPUGroupedMLP`` (experts via ``npu_grouped_matmul``).
- :mod:`~mcore_npu.transformer.norm_linear`: ``NormColumnParallelLinear``, the norm fused into
  ``linear_qkv`` / ``linear_fc1`` with TE's names (``layer_norm_weight``).
- :mod:`~mcore_npu.transformer.extra_state`: empty ``_extra_state`` entries where TE has them.
- :mod:`~mcore_npu.transformer.param_layout`: one tensor's names in the te and local layouts.
- :mod:`~mcore_npu.transformer.spec_provider`: ``NPUSpecProvider`` for Megatron's ``*_for_backend`` builders.
- :mod:`~mcore_npu.transformer.layer_specs`: ``get_gpt_layer_npu_spec``,
  ``get_gpt_decoder_block_npu_spec``, ``get_gpt_mtp_block_npu_spec``, ``get_gpt_layer_spec``.
- :mod:`~mcore_npu.transformer.backends`: which backend ``"auto"`` means on this machine.
- :mod:`~mcore_npu.transformer.pipeline_layout`: uneven pipeline stages (MindSpeed's per-stage
  list -> Megatron's first/last stage counts or layout); pure Python.
- :mod:`~mcore_npu.transformer.megatron_lm`: module-level layer specs for Megatron-LM's ``--spec``.

Built on :mod:`mcore_npu.masks` and :mod:`mcore_npu.ops`; imports Megatron-Core in its modules,
never in this ``__init__``. Nothing here patches Megatron, keeps global state or writes ``config``.
"""
