"""Moved to ``mcore_npu.allocator.workers`` (this path warns with a DeprecationWarning)."""

from mcore_npu._moved import alias

alias(__name__)
