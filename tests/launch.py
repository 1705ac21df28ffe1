"""Child processes for the tests: the trainer (plain or under torchrun) and any other command.

Every child starts in its own process session; on timeout the whole group is killed (killing only
the torchrun launcher would leave its workers running). The timeout guards against a hang, never
against slowness: one generous limit for the whole suite, ``HANG_TIMEOUT_S`` (20 minutes;
override with ``MCORE_NPU_TEST_TIMEOUT_S``). Tests judge speed only by ratios measured in one run.
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
HANG_TIMEOUT_S = float(os.environ.get("MCORE_NPU_TEST_TIMEOUT_S", "1200"))


def run_command(
    cmd, *, timeout: float | None = None, check: bool = False, **kwargs
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)`` in a new session.

    On timeout (``HANG_TIMEOUT_S`` unless given) the whole process group is killed and the test
    fails with the command and the end of its stderr; ``check=True`` fails it on a non-zero exit.
    """
    timeout = HANG_TIMEOUT_S if timeout is None else timeout
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"hung: no exit after {timeout:.0f}s: {cmd}\n{stderr[-3000:]}"
        ) from None
    assert not check or proc.returncode == 0, f"exit {proc.returncode}: {cmd}\n{stderr[-3000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


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
    extra_env=None,
    module="mcore_npu.training.train",
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
    proc = run_command(cmd, cwd=ROOT, env=env)
    seconds = time.perf_counter() - started
    records = []
    if metrics is not None and metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    return Run(proc.returncode, proc.stdout, proc.stderr, seconds, records)


def assert_ok(run: Run) -> Run:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stderr[-4000:]}"
    return run


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))
