"""Warnings: once per key (per-layer or per-step calls must not flood the log), and the
harmless ones megatron-core emits at import, which the command-line tools hide."""

from __future__ import annotations

import warnings


class _OnceRegistry:
    """The keys already warned about in this process (one owned set, clearable in tests)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def first_time(self, key: str) -> bool:
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def clear(self) -> None:
        self._seen.clear()


WARNED = _OnceRegistry()


def warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> bool:
    """Emit ``message`` the first time ``key`` is seen; return whether it was emitted."""
    if not WARNED.first_time(key):
        return False
    warnings.warn(message, category, stacklevel=3)
    return True


KNOWN_HARMLESS = (
    ".*Transformer Engine and Apex are not installed",  # megatron-core import, CPU machines
    ".*Apex is not installed",
    "full scope is deprecated",  # megatron-core 0.16's own TransformerConfig default
    "Please use DTensor instead",  # torch, inside dist_checkpointing's ShardedTensor use
)


def hide_known_harmless_warnings() -> None:
    """For command-line entry points only (they own the process); libraries never call this."""
    for pattern in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=pattern)
