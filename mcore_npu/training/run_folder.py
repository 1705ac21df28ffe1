"""The places a run writes to, checked before step 1: one run per folder, no silent overwrite.

``FolderLock`` (an ``fcntl`` lock on ``<checkpoint_dir>/.lock``), ``preflight_paths`` and
``check_free_space``, ``claim`` (checkpoints already there need ``train.resume`` or
``train.overwrite``), ``resume_point`` (the newest readable ``step_<N>``). Every refusal is a
one-line ``ConfigError`` naming the key, the path and the fix.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from mcore_npu.training import checkpointing
from mcore_npu.training.checkpointing import CheckpointError
from mcore_npu.training.config import ConfigError

LOCK_NAME = ".lock"
FREE_SPACE_MARGIN = 1.5  # a checkpoint may need this much more than its tensors' bytes
FREE_SPACE_SLACK = 8 << 20  # plus this much for common.pt, metadata and the file system


class FolderLock:
    """Exclusive lock on ``checkpoint_dir`` for this process; released by ``release`` or death."""

    def __init__(self, checkpoint_dir: str | Path) -> None:
        self.path = Path(checkpoint_dir) / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            problem = f"another run is using this folder ({holder})"
            fix = "wait for it to end, or give this run another train.checkpoint_dir"
            raise ConfigError("train.checkpoint_dir", str(checkpoint_dir), problem, fix) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (harmless, reused)
            self._fd = None


def preflight_paths(checkpoint_dir: str | None, metrics_file: str | None) -> None:
    """Create and write-test the checkpoint folder and the metrics file's folder."""
    if checkpoint_dir:
        _writable_folder("train.checkpoint_dir", Path(checkpoint_dir), "pass a writable folder")
    if metrics_file:
        path = Path(metrics_file)
        if path.is_dir():
            fix = "pass a file path such as runs/metrics.jsonl"
            raise ConfigError("train.metrics_file", metrics_file, "is a directory", fix)
        fix = "pass a file path in a writable folder, or train.metrics_file=null"
        _writable_folder("train.metrics_file", path.parent, fix, shown=metrics_file)
        if path.exists() and not os.access(path, os.W_OK):
            raise ConfigError("train.metrics_file", metrics_file, "is not writable", fix)


def _writable_folder(key: str, folder: Path, fix: str, shown: str | None = None) -> None:
    probe = folder / f".write_test.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as err:
        problem = f"cannot create or write {folder} ({err.strerror or err})"
        raise ConfigError(key, shown or str(folder), problem, fix) from None


def check_free_space(checkpoint_dir: str | Path, checkpoint_bytes: int) -> None:
    """Refuse to start when one more checkpoint of ``checkpoint_bytes`` would not fit."""
    needed = int(checkpoint_bytes * FREE_SPACE_MARGIN) + FREE_SPACE_SLACK
    free = shutil.disk_usage(checkpoint_dir).free
    if free < needed:
        problem = (
            f"only {free / 2**20:.1f} MiB free, one checkpoint needs about {needed / 2**20:.1f} MiB"
        )
        fix = "free space or pick a folder on a larger disk"
        raise ConfigError("train.checkpoint_dir", str(checkpoint_dir), problem, fix)


def claim(checkpoint_dir: str | Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse a folder holding checkpoints unless resuming; ``overwrite`` deletes them first."""
    folders = checkpointing.step_dirs(checkpoint_dir)
    has_latest = (Path(checkpoint_dir) / checkpointing.LATEST).exists()
    if resume or not (folders or has_latest):
        return
    if overwrite:
        for folder in folders:
            shutil.rmtree(folder)
        (Path(checkpoint_dir) / checkpointing.LATEST).unlink(missing_ok=True)
        return
    newest = f"its newest is {folders[0].name}" if folders else "it has a latest file"
    fix = (
        "continue that run with train.resume=true, or start fresh in another "
        "train.checkpoint_dir or with train.overwrite=true (deletes them)"
    )
    problem = f"already holds checkpoints ({newest})"
    raise ConfigError("train.checkpoint_dir", str(checkpoint_dir), problem, fix)


def resume_point(
    checkpoint_dir: str | Path,
    load: Callable[[Path], None],
    say: Callable[[str], None],
) -> Path | None:
    """Load the newest readable ``step_<N>`` folder with ``load`` (``latest``'s first, a damaged one
    skipped with a warning); None when there is none, ``CheckpointError`` when none loads."""
    named, latest_state = checkpointing.read_latest(checkpoint_dir)
    folders = checkpointing.step_dirs(checkpoint_dir)
    if named is not None:
        folders = [named, *(f for f in folders if f.name != named.name)]
    if not folders:
        say(f"no checkpoint in {checkpoint_dir} ({latest_state}): starting from step 0")
        return None
    skipped: list[str] = []
    for folder in folders:
        try:
            load(folder)
        except CheckpointError as err:
            skipped.append(str(err))
            continue
        for problem in skipped:
            warning = f"WARNING: skipping an unreadable checkpoint: {problem}; resuming from "
            say(warning + f"{folder.name} instead (delete the damaged folder to silence this)")
        why = "named by latest" if named == folder else f"the newest readable one; {latest_state}"
        say(f"resuming from {folder} ({why})")
        return folder
    raise CheckpointError(
        f"no readable checkpoint in {checkpoint_dir}: {' | '.join(skipped)}; delete the damaged "
        "step folders to resume from an earlier one, or start again with train.overwrite=true"
    )


def say_on_rank0(rank: int) -> Callable[[str], None]:
    def say(message: str) -> None:
        if rank == 0:
            print(f"mcore-npu train: {message}", file=sys.stderr, flush=True)

    return say
