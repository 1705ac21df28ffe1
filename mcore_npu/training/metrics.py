"""What a training run reports: a progress bar on the logging rank, JSON lines to a file.

Other ranks stay quiet. Each JSON line is one step::

    {"step": 3, "loss": 4.91, "lr": 0.0018, "grad_norm": 1.2, "tokens_per_s": 5120.0,
     "step_time_s": 0.2, "memory_bytes": 812000000}
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocator peak on an accelerator, max RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "npu":
        return int(torch.npu.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


class RunReporter:
    """Progress bar + JSON lines on the logging rank; a no-op elsewhere."""

    def __init__(
        self,
        *,
        enabled: bool,
        total_steps: int,
        first_step: int,
        metrics_file: str | None,
        progress: bool,
        resume: bool,
    ) -> None:
        self.enabled = enabled
        self._file = None
        self._bar = None
        if not enabled:
            return
        if metrics_file:
            path = Path(metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a" if resume else "w", encoding="utf-8")
        if progress:
            self._bar = tqdm(
                total=total_steps, initial=first_step, desc="train", unit="step",
                file=sys.stderr, dynamic_ncols=True,
            )  # fmt: skip
        self._started = time.perf_counter()

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._bar is not None:
            self._bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                mem=f"{record['memory_bytes'] / 2**20:.0f}MiB",
            )
            self._bar.update(record["step"] - self._bar.n)  # steps, also with log_interval > 1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
