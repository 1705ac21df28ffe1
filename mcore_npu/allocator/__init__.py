"""The allocator room: accelerator detection and expandable segments.

- :mod:`~mcore_npu.allocator.device`: which accelerator this process has (NPU, CUDA, CPU), the
  device to use, and ``set_expandable_segments`` / ``expandable_segments()``.
- :mod:`~mcore_npu.allocator.workers`: ``ExpandableSegmentsMixin``, which calls the setter first
  in a worker's ``__init__``.

Imports nothing above it (no Megatron, no torch at import). Used by the transformer room (for
``backend="auto"``), the trainer and the integrations.
"""
