"""The demo trainer around the plugin: ``mcore-npu train`` / ``python -m mcore_npu.train``.

YAML (:mod:`.config`) -> ``TransformerConfig`` + the NPU spec -> ``GPTModel`` (:mod:`.model`) ->
process groups and Megatron's parallel state (:mod:`.runtime`, with the CPU-only shims of
:mod:`.cpu_support`) -> batches (:mod:`.data`) -> Megatron's schedule, DDP and optimizer
(:mod:`.train`) -> ``dist_checkpointing`` checkpoints (:mod:`.checkpointing`) and metrics
(:mod:`.metrics`).

It uses the plugin (transformer, masks, ops, allocator) and owns no attention or spec logic.
"""
