"""``ExpandableSegmentsMixin``: turn expandable segments on when a worker is constructed.

Why a mixin: verl's ``TrainingWorker`` lost its allocator setting when PR 6346 removed the
``PYTORCH_NPU_ALLOC_CONF`` lines from ``__init__`` without adding a call to the runtime setter,
so standalone training workers on NPU never enabled expandable segments. Putting the call in a
mixin that runs first makes it impossible to drop while editing the worker's own ``__init__``::

    class TrainingWorker(ExpandableSegmentsMixin, Worker):
        def __init__(self, config):
            super().__init__()          # the mixin has already set the allocator here
            ...

The mixin does one thing: call :func:`mcore_npu.allocator.device.set_expandable_segments` at the start of
``__init__``, before the next class's ``__init__`` (process groups, device selection, model)
allocates anything, and record the outcome on the instance:

* ``self.expandable_segments_applied``: what the setter returned, i.e. whether the *requested*
  value (on or off) took effect;
* ``self.expandable_segments_enabled``: whether expandable segments are **on** for this
  process's new allocations (requested True and applied).
"""

from __future__ import annotations

from typing import Any

from mcore_npu.allocator.device import require_bool, set_expandable_segments

__all__ = ["ExpandableSegmentsMixin"]

# Instance marker: set once the setter has run for this object (diamond hierarchies, or
# __init__ called twice through explicit Base.__init__(self) calls).
_APPLIED = "_mcore_npu_expandable_segments_applied"


class ExpandableSegmentsMixin:
    """Cooperative mixin that sets expandable segments before the rest of ``__init__`` runs.

    Put it first among the bases: ``class W(ExpandableSegmentsMixin, Worker)``.

    Configuration, per class or per instance:

    * ``expandable_segments`` (class attribute, default True), overridden by the keyword
      argument ``expandable_segments=`` to the constructor.
    * ``expandable_segments_strict`` (class attribute, default False), overridden by
      ``expandable_segments_strict=``. When true, a setting that cannot take effect raises
      RuntimeError from the constructor instead of warning.

    Both keyword arguments are removed before the remaining positional and keyword arguments
    are passed, unchanged, to the next ``__init__`` in the MRO. The setter runs at most once per
    instance, however often this ``__init__`` is reached.

    Attributes:
        expandable_segments_enabled: True only when expandable segments are on for this
            process's new allocations: True was requested and the setter applied it. False
            after ``expandable_segments=False``, on CPU, and when enabling failed. (When a
            request to turn them *off* fails, the allocator keeps whatever it had before; the
            attribute still says False, meaning "not turned on here".)
        expandable_segments_applied: the return value of ``set_expandable_segments``: True if
            new allocations follow the *requested* value, whichever it was; False on CPU or
            when it could not be applied (see that function for each device).
    """

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
