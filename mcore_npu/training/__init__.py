"""The demo trainer around the plugin: ``mcore-npu train`` / ``python -m mcore_npu.train``.

YAML (:mod:`.config`) -> ``GPTModel`` (:mod:`.model`) -> parallel state (:mod:`.runtime`) ->
batches (:mod:`.data`) -> Megatron's schedule and optimizer (:mod:`.train`) -> checkpoints
(:mod:`.checkpointing`) and metrics (:mod:`.metrics`). It owns no attention or spec logic.
"""
