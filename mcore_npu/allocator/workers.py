"""``ExpandableSegmentsMixin``: turn expandable segments on when a worker is constructed.

A mixin first among the bases (``class TrainingWorker(ExpandableSegmentsMixin, Worker)``) calls
``set_expandable_segments`` before the next ``__init__`` allocates anything, so the call cannot
be dropped while editing the worker's own ``__init__`` (docs/expandable_segments.md).
"""

from __future__ import annotations

from typing import Any

from mcore_npu.allocator.device import require_bool, set_expandable_segments

__all__ = ["ExpandableSegmentsMixin"]

# set once the setter has run for this object (diamonds, or __init__ reached twice)
_APPLIED = "_mcore_npu_expandable_segments_applied"


class ExpandableSegmentsMixin:
    """Cooperative mixin that sets expandable segments before the rest of ``__init__`` runs.

    ``expandable_segments`` (default True) and ``expandable_segments_strict`` (default False) are
    class attributes or keyword arguments (removed before the next ``__init__``); the setter runs
    once per instance. ``expandable_segments_enabled``: on for new allocations (requested and
    applied); ``expandable_segments_applied``: the requested value, on or off, took effect."""

    expandable_segments: bool = True
    expandable_segments_strict: bool = False
    expandable_segments_enabled: bool
    expandable_segments_applied: bool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        enable = kwargs.pop("expandable_segments", self.expandable_segments)
        strict = kwargs.pop("expandable_segments_strict", self.expandable_segments_strict)
        if not getattr(self, _APPLIED, False):
            where = f"{type(self).__name__}.__init__"
            require_bool(where, "expandable_segments", enable)
            require_bool(where, "expandable_segments_strict", strict)
            setattr(self, _APPLIED, True)
            applied = set_expandable_segments(enable, strict=strict)
            self.expandable_segments_applied = applied
            self.expandable_segments_enabled = applied and enable
        super().__init__(*args, **kwargs)
