"""Moved to ``mcore_npu.transformer.layer_specs`` (this path warns with a DeprecationWarning)."""

from mcore_npu._moved import alias

alias(__name__)
