"""Warn once per distinct message key, so a per-layer or per-step call does not flood the log."""

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
