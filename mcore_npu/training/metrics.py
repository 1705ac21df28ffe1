"""What a training run reports: a progress bar on the logging rank, one JSON line per step.

A resumed run first cuts the file back to the resumed step (atomically), then appends; a fresh
run starts it again.
"""

from __future__ import annotations

import json
import os
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
        keep_through_step: int = 0,
    ) -> None:
        """``keep_through_step`` > 0 (a resumed run): keep the lines up to that step, append."""
        self.enabled = enabled
        self._file = None
        self._bar = None
        if not enabled:
            return
        if metrics_file:
            path = Path(metrics_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            if keep_through_step > 0:
                truncate_metrics(path, keep_through_step)
            self._file = path.open("a" if keep_through_step > 0 else "w", encoding="utf-8")
        if progress:
            steps = dict(total=total_steps, initial=first_step, desc="train", unit="step")
            self._bar = tqdm(**steps, file=sys.stderr, dynamic_ncols=True)
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


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the JSON lines of steps ``<= last_step`` (once each); write a temp file, rename."""
    if not path.is_file():
        return
    kept, seen = [], set()
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
        if isinstance(step, int) and step <= last_step and step not in seen:
            seen.add(step)
            kept.append(line + "\n")
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
