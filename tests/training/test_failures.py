"""``mcore-npu train`` broken on purpose: kills, signals, damaged checkpoints, shared or unwritable
folders, a full disk, bad data. Each test runs the real trainer as a subprocess, with real
signals (``os.kill``) and real files; resumed runs are compared with one uninterrupted run.

The signals sent *during a save* come from ``tests/training/signal_train.py``: the trainer sends
them to itself while the common state of the chosen step is being pickled (the step folder
exists, no tensor file yet), which no timing from outside could hit reliably.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import time

import pytest

from tests.launch import (
    ROOT,
    Background,
    assert_ok,
    max_abs_diff,
    read_metrics,
    run_command,
    session_members,
    train,
    train_command,
)

pytestmark = pytest.mark.slow

STEPS = 6
BASE = [f"train.steps={STEPS}", "train.seq_length=64", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.warmup_steps=1"]  # fmt: skip
SIGNAL_TRAIN = "tests.training.signal_train"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run, checkpoints at steps 2, 4, 6: ``(losses, checkpoint folder)``."""
    tmp = tmp_path_factory.mktemp("reference")
    run = assert_ok(train([*BASE, f"train.checkpoint_dir={tmp / 'ckpt'}", "train.save_interval=2"],
                          metrics=tmp / "m.jsonl"))  # fmt: skip
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    return run.losses, tmp / "ckpt"


def _run(tmp_path, *extra, module="mcore_npu.training.train", env=None):
    overrides = [*BASE, f"train.checkpoint_dir={tmp_path / 'ckpt'}", *extra]
    return train(overrides, metrics=tmp_path / "m.jsonl", module=module, extra_env=env)


def _resume_matches(tmp_path, reference, expect_from: int) -> None:
    """Resume in ``tmp_path``: it loads ``step_<expect_from>``; the metrics equal the reference."""
    run = assert_ok(_run(tmp_path, "train.resume=true"))
    assert f"resuming from {tmp_path / 'ckpt' / f'step_{expect_from:07d}'}" in run.stderr
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))  # each step once
    assert max_abs_diff(run.losses, reference[0]) <= 1e-6


def _latest(tmp_path) -> str:
    return (tmp_path / "ckpt" / "latest").read_text().strip()


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# -- kills and signals ------------------------------------------------------------------------


def test_sigkill_during_a_save_leaves_no_process_and_resume_loses_no_step(reference, tmp_path):
    cmd, env = train_command(
        [*BASE, f"train.checkpoint_dir={tmp_path / 'ckpt'}", "train.save_interval=2"],
        metrics=tmp_path / "m.jsonl", module=SIGNAL_TRAIN,
        extra_env={"SIGNAL_AT_SAVE": "4:SIGKILL"},
    )  # fmt: skip
    with Background(cmd, cwd=ROOT, env=env) as child:
        done = child.finish()
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    deadline = time.monotonic() + 10
    while session_members(child.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_members(child.proc.pid) == []  # no writer, Manager or tracker left behind
    sizes = {p: p.stat().st_size for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    time.sleep(0.5)
    assert sizes == {p: p.stat().st_size for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    assert not (tmp_path / "ckpt" / "step_0000004" / "metadata.json").exists()
    assert _latest(tmp_path) == "step_0000002"
    assert [m["step"] for m in read_metrics(tmp_path / "m.jsonl")] == [1, 2, 3, 4]
    _resume_matches(tmp_path, reference, expect_from=2)  # steps 3 and 4 trained again, once


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_a_save_finishes_it_and_stops(reference, tmp_path, sig):
    run = _run(tmp_path, "train.save_interval=2", module=SIGNAL_TRAIN,
               env={"SIGNAL_AT_SAVE": f"4:{sig.name}"})  # fmt: skip
    assert run.returncode == 128 + sig, run.stderr[-3000:]
    assert _last_line(run.stdout).startswith(
        f"mcore-npu train: interrupted at step 4 by {sig.name}"
    )
    assert "Traceback" not in run.stderr and "KeyboardInterrupt" not in run.stderr
    assert _latest(tmp_path) == "step_0000004"
    assert (tmp_path / "ckpt" / "step_0000004" / "metadata.json").is_file()
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4]
    _resume_matches(tmp_path, reference, expect_from=4)


def test_a_second_sigint_exits_at_once(tmp_path):
    run = _run(tmp_path, "train.save_interval=2", module=SIGNAL_TRAIN,
               env={"SIGNAL_AT_SAVE": "4:SIGINT,SIGINT"})  # fmt: skip
    assert run.returncode == 128 + signal.SIGINT, run.stderr[-3000:]
    assert "second SIGINT: exiting at once" in run.stderr
    assert "interrupted at step" not in run.stdout  # no summary: it did not wait for the save
    assert not (tmp_path / "ckpt" / "step_0000004" / "metadata.json").exists()
    assert _latest(tmp_path) == "step_0000002"


def test_a_second_run_on_the_folder_is_refused_and_sigterm_stops_the_first(reference, tmp_path):
    """Run A pauses after step 2; run B on the same folder is refused with A's PID and host;
    SIGTERM from outside then stops A after step 3 with a checkpoint, which resumes."""
    cmd, env = train_command(
        [*BASE, f"train.checkpoint_dir={tmp_path / 'ckpt'}", "train.save_interval=2"],
        metrics=tmp_path / "m.jsonl", module=SIGNAL_TRAIN,
        extra_env={"PAUSE_AT_STEP": "2", "PAUSE_UNTIL": str(tmp_path / "go")},
    )  # fmt: skip
    with Background(cmd, cwd=ROOT, env=env) as first:
        first.wait_for(lambda: (tmp_path / "go.paused").exists(), "the pause after step 2")
        second = _run(tmp_path / "second", f"train.checkpoint_dir={tmp_path / 'ckpt'}")
        first.signal(signal.SIGTERM)
        (tmp_path / "go").touch()
        done = first.finish()
    assert second.returncode == 2
    line = _last_line(second.stderr)
    assert "another run is using this folder" in line
    assert f"pid {first.proc.pid} on host {socket.gethostname()}" in line
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert "interrupted at step 3 by SIGTERM" in _last_line(done.stdout)
    assert _latest(tmp_path) == "step_0000003"
    _resume_matches(tmp_path, reference, expect_from=3)


# -- damaged checkpoints and latest -----------------------------------------------------------


def _copy_reference(reference, tmp_path):
    shutil.copytree(reference[1], tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".lock").unlink(missing_ok=True)
    lines = [json.dumps({"step": s, "loss": x}) for s, x in enumerate(reference[0], start=1)]
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path / "ckpt"


def _megatron_writes_common_pt() -> bool:
    """Whether the installed ``dist_checkpointing.save`` takes a ``common_strategy`` (it writes
    ``common.pt``: megatron-core <= 0.18; 0.19 keeps the common state in the ``.distcp`` files)."""
    import inspect

    from megatron.core import dist_checkpointing

    return "common_strategy" in inspect.signature(dist_checkpointing.save).parameters


def test_resume_without_latest_falls_back_past_damaged_checkpoints(reference, tmp_path):
    ckpt = _copy_reference(reference, tmp_path)
    (ckpt / "latest").unlink()
    data = ckpt / "step_0000006" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated tensor file
    # the common state: common.pt where Megatron writes one (<= 0.18), else the .distcp index
    removed = "common.pt" if _megatron_writes_common_pt() else ".metadata"
    assert (ckpt / "step_0000004" / removed).is_file(), sorted(os.listdir(ckpt / "step_0000004"))
    (ckpt / "step_0000004" / removed).unlink()
    run = assert_ok(_run(tmp_path, "train.resume=true"))
    assert "step_0000006: __0_0.distcp is truncated" in run.stderr
    assert f"step_0000004: {removed} is missing" in run.stderr
    assert run.stderr.count("WARNING: skipping an unreadable checkpoint") == 2
    assert (
        f"resuming from {ckpt / 'step_0000002'}" in run.stderr and "latest is missing" in run.stderr
    )
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    assert max_abs_diff(run.losses, reference[0]) <= 1e-6


def test_resume_with_a_dangling_latest_loads_the_newest_folder(reference, tmp_path):
    ckpt = _copy_reference(reference, tmp_path)
    (ckpt / "latest").write_text("step_0000008\n")
    run = assert_ok(_run(tmp_path, "train.resume=true"))
    assert f"resuming from {ckpt / 'step_0000006'}" in run.stderr
    assert "latest names step_0000008, which does not exist" in run.stderr
    assert _last_line(run.stdout).startswith(f"mcore-npu train: done steps={STEPS}")
    assert max_abs_diff(run.losses, reference[0]) <= 0.0  # nothing trained, nothing rewritten


def test_no_readable_checkpoint_is_one_line(reference, tmp_path):
    ckpt = _copy_reference(reference, tmp_path)
    for step in (4, 6):
        shutil.rmtree(ckpt / f"step_{step:07d}")
    (ckpt / "step_0000002" / ".metadata").write_bytes(os.urandom(300))
    (ckpt / "latest").write_text("")
    run = _run(tmp_path, "train.resume=true")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    line = _last_line(run.stderr)
    assert f"no readable checkpoint in {ckpt}" in line
    assert "step_0000002: .metadata is unreadable" in line and "delete the damaged" in line


# -- run folders, preflight, full disk --------------------------------------------------------


def test_a_used_folder_is_refused_without_resume_and_overwrite_starts_again(reference, tmp_path):
    ckpt = _copy_reference(reference, tmp_path)
    run = _run(tmp_path, "train.steps=4")
    assert run.returncode == 2
    line = _last_line(run.stderr)
    assert f"train.checkpoint_dir='{ckpt}'" in line and "its newest is step_0000006" in line
    assert "train.resume=true" in line and "train.overwrite=true" in line
    assert _latest(tmp_path) == "step_0000006" and len(read_metrics(tmp_path / "m.jsonl")) == 6
    again = assert_ok(_run(tmp_path, "train.steps=1", "train.overwrite=true"))
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_0000001"]
    assert [m["step"] for m in again.metrics] == [1]


@pytest.mark.parametrize("case", ["checkpoint_dir in /proc", "metrics_file a directory",
                                  "metrics_file under a file"])  # fmt: skip
def test_unwritable_places_are_refused_before_step_1(tmp_path, case):
    (tmp_path / "a_file").write_text("x")
    key, value = {
        "checkpoint_dir in /proc": ("train.checkpoint_dir", "/proc/x"),
        "metrics_file a directory": ("train.metrics_file", str(tmp_path)),
        "metrics_file under a file": ("train.metrics_file", str(tmp_path / "a_file" / "m.jsonl")),
    }[case]
    run = train([*BASE, f"{key}={value}"])
    assert run.returncode == 2 and "Traceback" not in run.stderr
    line = _last_line(run.stderr)
    assert line.startswith(f"mcore-npu train: error: config {key}='{value}'")
    assert "pass a" in line  # the fix


def _unshare_works() -> bool:
    probe = (
        run_command(["unshare", "-Urm", "true"], timeout=60) if shutil.which("unshare") else None
    )
    return probe is not None and probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs unprivileged user+mount namespaces "
                    "(unshare -Urm) to mount a small private tmpfs")  # fmt: skip
def test_a_full_disk_fails_the_save_with_the_cause_and_keeps_the_previous_one(tmp_path):
    """A private 20 MiB tmpfs (real ENOSPC): it passes the preflight (one checkpoint is ~6 MiB),
    holds three checkpoints, and the fourth save runs out of space."""
    disk, report = tmp_path / "disk", tmp_path / "report"
    disk.mkdir()
    cmd, env = train_command([*BASE, f"train.checkpoint_dir={disk / 'ckpt'}",
                              "train.save_interval=1"], metrics=tmp_path / "m.jsonl")  # fmt: skip
    script = (f'mount -t tmpfs -o size=20m tmpfs "{disk}" && "$@"; rc=$?; '
              f'cat "{disk}/ckpt/latest" > "{report}.latest"; ls "{disk}/ckpt" > "{report}.ls"; '
              "exit $rc")  # fmt: skip
    proc = run_command(["unshare", "-Urm", "sh", "-c", script, "sh", *cmd], cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = _last_line(proc.stderr)
    assert f"saving checkpoint {disk / 'ckpt' / 'step_0000004'} failed: no space left" in line
    assert "step_0000003 is still the latest valid checkpoint" in line
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "report.latest").read_text().strip() == "step_0000003"
    listed = (tmp_path / "report.ls").read_text().split()
    assert listed == ["latest", "step_0000001", "step_0000002", "step_0000003"]


# -- bad data ---------------------------------------------------------------------------------

BAD_DATA = {
    "empty": (b"", "is empty"),
    "binary": (bytes(range(256)) * 4, "looks binary (a NUL byte at offset 0)"),
    "latin-1": (
        "café au lait ".encode("latin-1") * 40,
        "is not UTF-8 text (byte 0xe9 at offset 3)",
    ),
    "directory": (None, "is a directory"),
    "too short": (b"a short text", "has 12 bytes, fewer than one sample needs"),
}


@pytest.mark.parametrize("kind", list(BAD_DATA))
def test_bad_data_is_refused_before_process_groups(tmp_path, kind):
    content, problem = BAD_DATA[kind]
    path = tmp_path / "data"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    run = train([*BASE, f"data.path={path}", f"train.checkpoint_dir={tmp_path / 'ckpt'}"])
    assert run.returncode == 2 and "Traceback" not in run.stderr
    line = _last_line(run.stderr)
    assert line.startswith(f"mcore-npu train: error: config data.path='{path}': {problem}")
    assert "UTF-8" in line or "train.seq_length" in line  # the fix
    assert not (tmp_path / "ckpt").exists()  # refused before anything was created


# -- the pieces, in process (real files, no trainer) ------------------------------------------


@pytest.mark.parametrize("content, state", [
    (None, "latest is missing"),
    (b"", "latest is empty"),
    (b"\xff\xfe\x00garbage", "latest is unreadable (UnicodeDecodeError)"),
    (b"../etc\n", "latest holds '../etc', not a step folder name"),
    (b"step_0000009\n", "latest names step_0000009, which does not exist"),
    (b"step_0000002\n", "latest names step_0000002"),
])  # fmt: skip
def test_every_state_of_latest_is_named(tmp_path, content, state):
    from mcore_npu.training import checkpointing

    (tmp_path / "step_0000002").mkdir()
    if content is not None:
        (tmp_path / "latest").write_bytes(content)
    named, described = checkpointing.read_latest(tmp_path)
    assert described == state
    assert named == (tmp_path / "step_0000002" if state == "latest names step_0000002" else None)


def test_latest_is_replaced_by_a_rename(tmp_path):
    from mcore_npu.training import checkpointing

    (tmp_path / "latest").write_text("step_0000001\n")
    before = (tmp_path / "latest").stat().st_ino
    checkpointing.write_latest(tmp_path, tmp_path / "step_0000002")
    assert (tmp_path / "latest").read_text() == "step_0000002\n"
    assert (tmp_path / "latest").stat().st_ino != before  # a new file renamed over the old one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # no temporary file left


def test_metrics_are_cut_back_to_the_resumed_step(tmp_path):
    from mcore_npu.training.metrics import truncate_metrics

    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in (1, 2, 3, 2, 3, 4)]
    path.write_text("\n".join(lines) + '\n{"step": 5, "lo')  # a repeat and a line cut by a kill
    truncate_metrics(path, 3)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]


def test_the_folder_lock_names_its_holder_and_dies_with_it(tmp_path):
    from mcore_npu.training.config import ConfigError
    from mcore_npu.training.run_folder import FolderLock

    lock = FolderLock(tmp_path)
    with pytest.raises(ConfigError, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
        FolderLock(tmp_path)  # flock locks open files: a second open in one process conflicts
    lock.release()
    FolderLock(tmp_path).release()


def test_overwrite_and_resume_together_are_refused():
    from mcore_npu.training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.overwrite=True: and train.resume=true"):
        load_config(None, ["train.overwrite=true", "train.resume=true", "train.checkpoint_dir=x"])
