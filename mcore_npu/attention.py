"""Moved to ``mcore_npu.transformer.attention`` (this path warns with a DeprecationWarning)."""

from mcore_npu._moved import alias

alias(__name__)
