"""``mcore-npu bench {mask,attention} --quick`` end to end, each in its own interpreter.

The command exits 0 only when every memory goal of the result is met (time goals are judged
in full runs), writes ``<out>/<name>.json``
(rows, goals) and ``<out>/<name>.png``. It runs as ``python -m mcore_npu.tools.bench ...``, the same
as the ``mcore-npu bench`` console script.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.launch import run_command

EXPECTED_ROW_KEYS = {
    "mask": {"S", "B", "method", "peak_bytes", "seconds"},
    "attention": {"S", "method", "seconds", "peak_bytes"},
    "step": {"seq_length", "time_ratio", "npu_fusion_peak_bytes", "local_peak_bytes"},
}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["mask", "attention", "step"])
def test_quick_benchmark_writes_json_and_png(which, tmp_path):
    done = run_command(
        [sys.executable, "-m", "mcore_npu.tools.bench", which, "--quick", "--out", str(tmp_path)],
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    result = json.loads((tmp_path / f"{which}.json").read_text())
    assert result["name"] == which
    assert result["rows"], "no rows measured"
    for row in result["rows"]:
        assert EXPECTED_ROW_KEYS[which] <= row.keys(), row
        assert all(row[key] >= 0 for key in row if "peak" in key), row  # the causal path: 0
        assert all(row[key] > 0 for key in row if "seconds" in key), row
    if which == "step":  # the MoE rows: grouped experts and SequentialMLP, measured together
        for row in result["moe_rows"]:
            assert row["grouped_seconds"] > 0 and row["sequential_seconds"] > 0, row
            assert row["grouped_peak_bytes"] > 0 and row["sequential_peak_bytes"] > 0, row
            assert row["time_ratio"] == row["grouped_seconds"] / row["sequential_seconds"]
    assert result["goals"]
    assert all(goal["met"] for goal in result["goals"] if goal["kind"] == "memory")
    assert all(goal["measured"] > 0 for goal in result["goals"] if goal["kind"] == "time")
    png = tmp_path / f"{which}.png"
    assert png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goal met" in done.stdout
