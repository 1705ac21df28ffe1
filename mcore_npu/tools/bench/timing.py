"""Side-by-side timing: candidates run interleaved in one process, reported as medians.

Machines here are noisy, so absolute times mean little; what a benchmark reports is the ratio
of medians of candidates that ran round-robin in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_medians(
    candidates: dict[str, Callable[[], object]], *, repeats: int = 7, warmup: int = 1
) -> dict[str, float]:
    """Median seconds per call of each candidate, calling them round-robin ``repeats`` times."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}
