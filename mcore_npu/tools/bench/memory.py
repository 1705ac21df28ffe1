"""A deterministic peak-allocation tracker for CPU (and CUDA) code.

``track_allocations()`` replays, in order, every allocation and free the PyTorch allocator
reports to the profiler while the block runs (kernels' internal buffers included), so the
figures do not depend on timing or load. ``peak_bytes``: the most bytes allocated inside the
block and alive at once; ``allocated_bytes``: the sum of its allocations; ``live_bytes``: what it
allocated and had not freed at the end (negative if it freed more).

    >>> with track_allocations() as usage:
    ...     x = torch.ones(1024, 1024)
    >>> usage.peak_bytes
    4194304
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from torch.profiler import ProfilerActivity, profile


@dataclass
class AllocationUsage:
    """``sizes``: the byte size of every allocation, in order (to spot one tensor's shape)."""

    peak_bytes: int = 0
    live_bytes: int = 0
    allocated_bytes: int = 0
    allocations: int = 0
    sizes: list[int] = field(default_factory=list)


@contextlib.contextmanager
def track_allocations():
    """Context manager yielding an ``AllocationUsage`` filled in when the block exits."""
    from torch._C._profiler import _EventType

    usage = AllocationUsage()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield usage
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    events.sort()
    live = 0
    for _, size in events:
        live += size
        usage.peak_bytes = max(usage.peak_bytes, live)
        if size > 0:
            usage.allocated_bytes += size
            usage.allocations += 1
            usage.sizes.append(size)
    usage.live_bytes = live


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's native start/stop banner goes to fd 2; keep it out of reports."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
