"""``mcore-npu train`` end to end: real megatron-core, real dist_checkpointing, CPU processes."""

from __future__ import annotations

import math
import sys

import pytest

from tests.launch import (
    ROOT,
    assert_ok,
    layout_runs,
    max_abs_diff,
    read_metrics,
    run_command,
    train,
)

pytestmark = pytest.mark.slow


@pytest.mark.cpu_only
def test_demo_config_trains_and_loss_falls_by_30_percent(tmp_path):
    run = assert_ok(train([], metrics=tmp_path / "m.jsonl"))
    first, last = run.losses[0], run.losses[-1]
    assert len(run.losses) == 60
    assert last <= 0.7 * first, (first, last)
    summary = run.stdout.strip().splitlines()[-1]
    assert summary.startswith("mcore-npu train: done steps=60")
    assert "backend=npu_fusion kernel=reference expandable_segments=off" in summary


@pytest.mark.cpu_only
def test_mla_config_trains_and_loss_falls_by_30_percent(tmp_path):
    """``mcore-npu train --config configs/gpt_tiny_mla.yaml`` as written: 60 steps of the tiny
    DeepSeek-V3-shaped model (MLA, the DeepSeek-V3 router, a shared expert) lower the loss by at
    least 30 %, through the NPU spec's MLA attention and grouped experts."""
    run = assert_ok(train([], config="gpt_tiny_mla.yaml", metrics=tmp_path / "m.jsonl"))
    first, last = run.losses[0], run.losses[-1]
    assert len(run.losses) == 60
    assert last <= 0.7 * first, (first, last)
    print(f"gpt_tiny_mla: loss {first:.2f} -> {last:.2f} in 60 steps", file=sys.stderr)
    assert "mcore-npu train: done steps=60" in run.stdout


def test_progress_bar_and_console_script(tmp_path):
    cmd = [str(ROOT / ".venv" / "bin" / "mcore-npu")]
    if not (ROOT / ".venv" / "bin" / "mcore-npu").exists():  # an installed environment elsewhere
        cmd = [sys.executable, "-m", "mcore_npu"]
    proc = run_command(
        [*cmd, "train", "--config", str(ROOT / "configs" / "gpt_tiny.yaml"), "train.steps=3",
         f"train.metrics_file={tmp_path / 'm.jsonl'}"], cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train: 100%" in proc.stderr and "loss=" in proc.stderr  # tqdm on rank 0
    assert "done steps=3" in proc.stdout


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    straight = assert_ok(train(["train.steps=10"], metrics=tmp_path / "straight.jsonl"))
    common = ["train.steps=10", f"train.checkpoint_dir={tmp_path / 'ckpt'}"]
    first = assert_ok(train([*common, "train.exit_interval=5"], metrics=tmp_path / "resumed.jsonl"))
    assert len(first.losses) == 5 and (tmp_path / "ckpt" / "step_0000005").is_dir()
    second = assert_ok(train([*common, "train.resume=true"], metrics=tmp_path / "resumed.jsonl"))
    assert len(second.losses) == 10  # the file continues where the first run stopped
    assert max_abs_diff(straight.losses, second.losses) <= 1e-6


@pytest.fixture(scope="module")
def backend_runs(tmp_path_factory) -> dict[str, list[float]]:
    """Losses of 6 steps with each backend, and of each resumed from the other's step-3
    checkpoint. Two launches of ``tests.launch.layout_runs`` (several trainer runs one after
    another in one process): the runs and saves, then the resumes, in a fresh process."""
    tmp = tmp_path_factory.mktemp("backends")
    first, resumes = [], []
    for backend in ("local", "npu_fusion"):
        base = ["train.steps=6", f"attention.backend={backend}", "train.progress=false"]
        first.append([backend, [*base, f"train.metrics_file={tmp / backend}.jsonl"]])
        first.append([f"{backend}_save", [*base, f"train.checkpoint_dir={tmp / backend}",
                                          "train.exit_interval=3"]])  # fmt: skip
    for saved, loaded in (("local", "npu_fusion"), ("npu_fusion", "local")):
        resumes.append([f"{saved}->{loaded}", [
            "train.steps=6", f"attention.backend={loaded}", "train.resume=true",
            f"train.checkpoint_dir={tmp / saved}", "train.progress=false",
            f"train.metrics_file={tmp / saved}-{loaded}.jsonl"]])  # fmt: skip
    layout_runs("gpt_tiny.yaml", first)
    layout_runs("gpt_tiny.yaml", resumes)
    files = {"local": "local", "npu_fusion": "npu_fusion", "local->npu_fusion": "local-npu_fusion",
             "npu_fusion->local": "npu_fusion-local"}  # fmt: skip
    return {name: [m["loss"] for m in read_metrics(tmp / f"{file}.jsonl")]
            for name, file in files.items()}  # fmt: skip


def test_npu_fusion_trains_like_megatron_local_spec(backend_runs):
    assert len(backend_runs["local"]) == 6
    assert max_abs_diff(backend_runs["local"], backend_runs["npu_fusion"]) <= 1e-5


@pytest.mark.parametrize("saved, loaded", [("local", "npu_fusion"), ("npu_fusion", "local")])
def test_checkpoint_moves_between_backends(backend_runs, saved, loaded):
    resumed = backend_runs[f"{saved}->{loaded}"]  # steps 4..6 after loading step 3
    assert len(resumed) == 3
    assert max_abs_diff(resumed, backend_runs[saved][3:]) <= 1e-5


def test_packed_sequences_train_like_unpacked(tmp_path):
    dense = assert_ok(train(["train.steps=4"], metrics=tmp_path / "dense.jsonl"))
    packed = assert_ok(train(["train.steps=4", "data.pack_sequences=true"],
                             metrics=tmp_path / "packed.jsonl"))  # fmt: skip
    assert max_abs_diff(dense.losses, packed.losses) <= 1e-5


def test_bad_config_exits_2_with_one_line_before_any_process_group(tmp_path):
    run = train(["parallel.tensor=3"], metrics=tmp_path / "m.jsonl")
    assert run.returncode == 2
    assert (
        run.stderr.strip()
        .splitlines()[-1]
        .startswith("mcore-npu train: error: config parallel.tensor=3: does not divide")
    )
    assert "Traceback" not in run.stderr and not (tmp_path / "m.jsonl").exists()


@pytest.mark.cpu_only
def test_bf16_trains_on_cpu_with_fp32_main_params(tmp_path):
    """Megatron's mixed-precision optimizer (bf16 model, fp32 main params) on a CPU: the
    constructors' CUDA type check is answered by ``cpu_support.CudaTypeNames``."""
    run = assert_ok(train(["train.dtype=bf16", "train.steps=4", "train.log_interval=1"],
                          metrics=tmp_path / "m.jsonl"))  # fmt: skip
    assert len(run.losses) == 4 and all(math.isfinite(x) for x in run.losses)
    assert run.losses[-1] < run.losses[0], run.losses


def test_memory_config_reaches_the_mixin(monkeypatch):
    from mcore_npu.allocator import workers
    from mcore_npu.training import train as train_module
    from mcore_npu.training.config import load_config

    calls = []

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(workers, "set_expandable_segments",
                        lambda enable, strict=False: calls.append((enable, strict)) or False)  # fmt: skip
    monkeypatch.setattr(train_module.runtime, "initialize", stop)
    for enable, strict in ((True, False), (False, True)):
        cfg = load_config(None, [f"memory.expandable_segments={enable}", f"memory.strict={strict}"])
        with pytest.raises(Stop):
            train_module.Trainer(cfg)
    assert calls == [(True, False), (False, True)]  # set before anything else in __init__
