"""The trainable Ascend C chain of flash-linear-attention-npu (``fla_npu``): placeholder."""

from __future__ import annotations


def available() -> bool:
    """Whether the fla_npu building blocks import (not wired yet: never)."""
    return False


def unsupported(q, v, initial_state) -> str | None:
    return "not wired yet"


def run(*args, **kwargs):
    raise NotImplementedError("kernel='fla_npu' is not wired yet; use kernel='auto'")
