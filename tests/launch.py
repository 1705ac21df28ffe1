"""Run ``mcore_npu.train`` in child processes (plain or under torchrun) and read its metrics.

Each run starts in its own process session; on timeout the whole group is killed (killing only
the torchrun launcher would leave its workers running).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
TORCHRUN = Path(sys.executable).with_name("torchrun")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    metrics: list[dict]

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]


def train(
    overrides,
    *,
    config="gpt_tiny.yaml",
    nproc=1,
    metrics=None,
    timeout=240,
    extra_env=None,
    module="mcore_npu.train",
) -> Run:
    """``[torchrun --standalone --nproc-per-node N] -m module --config ... overrides``."""
    metrics = Path(metrics) if metrics else None
    args = ["--config", str(CONFIGS / config), "train.progress=false", *overrides]
    if metrics is not None:
        args.append(f"train.metrics_file={metrics}")
    if nproc == 1:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", "-m", module, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(extra_env or {})}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {cmd}\n{stderr[-3000:]}") from None
    seconds = time.perf_counter() - started
    records = []
    if metrics is not None and metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    return Run(proc.returncode, stdout, stderr, seconds, records)


def assert_ok(run: Run) -> Run:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stderr[-4000:]}"
    return run


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))
