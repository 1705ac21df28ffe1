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


def train_command(
    overrides,
    *,
    config="gpt_tiny.yaml",
    nproc=1,
    metrics=None,
    extra_env=None,
    module="mcore_npu.training.train",
    prefix=(),
) -> tuple[list[str], dict]:
    """The command line and environment of ``train`` (``prefix`` goes before python)."""
    args = ["--config", str(CONFIGS / config), "train.progress=false", *overrides]
    if metrics is not None:
        args.append(f"train.metrics_file={metrics}")
    if nproc == 1:
        cmd = [*prefix, sys.executable, "-m", module, *args]
    else:
        cmd = [*prefix, str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", "-m", module,
               *args]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(extra_env or {})}
    return cmd, env


def train(overrides, *, metrics=None, **kwargs) -> Run:
    """``[torchrun --standalone --nproc-per-node N] -m module --config ... overrides``."""
    metrics = Path(metrics) if metrics else None
    cmd, env = train_command(overrides, metrics=metrics, **kwargs)
    started = time.perf_counter()
    proc = run_command(cmd, cwd=ROOT, env=env)
    seconds = time.perf_counter() - started
    return Run(proc.returncode, proc.stdout, proc.stderr, seconds, read_metrics(metrics))


def layout_runs(
    config: str | Path, runs: list, nproc: int = 1, module: str = "tests.distributed.layout_runs"
) -> str:
    """Several trainer runs one after another in ONE launch (``tests/distributed/layout_runs.py``:
    one rendezvous, one import of Megatron per process for all of them): ``runs`` is a list of
    ``[name, [override, ...]]``, ``config`` a file of configs/ or a path; plain python when
    ``nproc`` is 1, torchrun otherwise; ``module``: the entry point (one that wraps
    layout_runs). Asserts the launch succeeded; returns its stdout, where :func:`reported`
    finds each run's lines."""
    args = ["-m", module, str(CONFIGS / config), json.dumps(runs)]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    done = run_command(cmd, cwd=ROOT, env=env)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-4000:]}"
    return done.stdout


def reported(stdout: str, name: str, what: str) -> str:
    """What ``layout_runs`` printed once for run ``name`` under ``what`` (``layout``:
    Megatron's parallel sizes as JSON, ``modules``: the classes the last layer trained)."""
    prefix = f"layout_runs: {name} {what}: "
    lines = [line[len(prefix) :] for line in stdout.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, (name, what, stdout[-2000:])
    return lines[0]


def read_metrics(metrics: Path | None) -> list[dict]:
    """The JSON lines of ``metrics`` (every line must parse), or [] without a file."""
    if metrics is None or not metrics.is_file():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line]


class Background:
    """A child in its own session, running while the test acts on it (signals, a second run).

    ``finish`` waits for it (hang guard: ``HANG_TIMEOUT_S``); leaving the ``with`` block kills
    the whole process group whatever happened, so no child outlives the test.
    """

    def __init__(self, cmd, **kwargs) -> None:
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True, **kwargs)  # fmt: skip

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child itself (not its group: a launcher forwards it on its own)."""
        os.kill(self.proc.pid, sig)

    def wait_for(self, condition, what: str, timeout: float | None = None) -> None:
        """Poll ``condition()`` until true; fail if the child exits first or it hangs."""
        deadline = time.monotonic() + (HANG_TIMEOUT_S if timeout is None else timeout)
        while not condition():
            if self.proc.poll() is not None:
                _, stderr = self.proc.communicate()
                raise AssertionError(
                    f"exited {self.proc.returncode} before {what}\n{stderr[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"hung: no {what} after {timeout}s: {self.cmd}")
            time.sleep(0.05)

    def finish(self) -> subprocess.CompletedProcess:
        try:
            stdout, stderr = self.proc.communicate(timeout=HANG_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            stdout, stderr = self.proc.communicate()
            raise AssertionError(f"hung: {self.cmd}\n{stderr[-3000:]}") from None
        return subprocess.CompletedProcess(self.cmd, self.proc.returncode, stdout, stderr)


def session_members(sid: int) -> list[int]:
    """PIDs of live processes in session ``sid`` (what a child started, even re-parented)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def assert_ok(run: Run) -> Run:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stderr[-4000:]}"
    return run


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


def assert_layout_matches(
    stdout: str, name: str, metrics, single, expected: dict, sp: bool, tolerance: float
) -> None:
    """Run ``name`` of a ``layout_runs`` launch had the ``expected`` sizes (``tp``, ``cp``,
    ``ep``, ``dp``) and ``sp``, and its losses and gradient norms are those of the one-process
    ``single`` run within ``tolerance``, step by step."""
    had = json.loads(reported(stdout, name, "layout"))
    assert {key: had[key] for key in ("tp", "cp", "ep", "dp")} == expected, had
    assert had["sp"] == sp, had
    assert len(metrics) == len(single) > 0, (metrics, single)
    for key in ("loss", "grad_norm"):
        got, want = [m[key] for m in metrics], [m[key] for m in single]
        assert max_abs_diff(got, want) <= tolerance, (key, got, want)
