"""``mcore-npu bench {mask,attention,step,cp} --quick`` end to end, each in its own interpreter.

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


@pytest.mark.slow
@pytest.mark.distributed
def test_quick_cp_benchmark_is_consistent(tmp_path):
    """``bench cp --quick``: one launch of 2 gloo ranks; figures checked against each other.

    Bytes sent per rank equal the closed-form theory exactly (gloo's all-reduce standing in for
    the reduce-scatter), both ranks send the same, peaks hold at least the tensors a pass must
    return, no host sync outside the CPU reference kernel while the counter does see a planted
    ``.item()`` and ``.tolist()``.
    """
    from mcore_npu.tools.bench import cp

    done = run_command(
        [sys.executable, "-m", "mcore_npu.tools.bench", "cp", "--quick", "--out", str(tmp_path)],
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    result = json.loads((tmp_path / "cp.json").read_text())
    assert (tmp_path / "cp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["sync_check"]["positive_control_syncs"] == [2, 2]
    rows = {row["comm"]: row for row in result["rows"]}
    assert set(rows) == {None, *cp.COMM_TYPES}
    shape, seq = result["shape"], result["shape"]["S"]
    for comm, row in rows.items():
        local = seq // row["cp"]
        out_bytes = local * shape["batch"] * shape["heads"] * shape["head_dim"] * 4
        kv_bytes = local * shape["batch"] * shape["groups"] * shape["head_dim"] * 4
        fwd, bwd = row["forward"], row["backward"]
        assert fwd["peak_bytes"] >= out_bytes and fwd["retained_bytes"] >= out_bytes, row
        assert bwd["peak_bytes"] >= out_bytes + 2 * kv_bytes, row  # dq, dk, dv
        assert fwd["resident_peak_bytes"] == fwd["peak_bytes"] + out_bytes + 2 * kv_bytes  # + q/k/v
        assert row["sync"]["per_layer_outside_reference_kernel"] == 0, row["sync"]
        for phase in (fwd, bwd):
            assert len(phase["bytes_sent_values"]) == 1, phase  # every rank and repeat
            assert not any(name.startswith("unknown") for name in phase["calls"]), phase
        if comm != "all_gather":  # the design's floor is a lower bound of what was measured
            assert fwd["resident_peak_bytes"] >= fwd["floor_bytes"] == cp.floor_bytes(comm, seq)
        if comm is None:
            assert fwd["bytes_sent"] == bwd["bytes_sent"] == 0 and not fwd["calls"]
            continue
        theory = cp.theory_bytes(comm, seq)
        assert (fwd["bytes_sent"], bwd["bytes_sent"]) == (theory["forward"], theory["backward"])
    # CP=2 ring: K and V as two messages, one hop forward; backward K/V once, dK/dV twice
    assert rows["p2p"]["forward"]["calls"] == {"c10d.send": 2, "c10d.recv_": 2}
    assert rows["p2p"]["backward"]["calls"] == {"c10d.send": 6, "c10d.recv_": 6}
    # sbhd Ulysses, point to point: 4 exchanges per pass (q, k, v, out), 2 chunks each
    for phase in ("forward", "backward"):
        assert rows["a2a"][phase]["calls"] == {"c10d.send": 8, "c10d.recv_": 8}
    # all_gather: K and V each gathered in two halves straight into natural order
    assert rows["all_gather"]["forward"]["calls"] == {"c10d._allgather_base_": 4}
    assert rows["all_gather"]["backward"]["calls"] == {"c10d.allreduce_": 2}
    assert "goal met: host syncs per layer" in done.stdout


@pytest.mark.parametrize("heads, groups", [(8, 8), (8, 2), (32, 8), (32, 1), (64, 1)])
def test_cp_floors_stay_above_the_goal_for_every_head_shape(heads, groups):
    """The designs' forward floors at CP=2 over CP=1's (``bench.cp`` docstring): ring >= 0.5625,
    Ulysses >= 0.75 whatever the heads, both above the issue's 0.55; CP=1's floor is exactly
    q, k, v and the output."""
    from mcore_npu.tools.bench import cp

    shape = {"heads": heads, "groups": groups, "head_dim": 64, "batch": 1}
    seq = 16384
    cp1 = cp.floor_bytes(None, seq, **shape)
    assert cp1 == seq * 64 * 4 * (2 * heads + 2 * groups)
    ring, ulysses = (cp.floor_bytes(comm, seq, **shape) / cp1 for comm in ("p2p", "a2a"))
    assert cp.PEAK_GOAL < 0.5625 <= ring <= 0.625 and 0.75 <= ulysses <= 0.875
    with pytest.raises(ValueError, match="all_gather"):
        cp.floor_bytes("all_gather", seq, **shape)


@pytest.mark.parametrize("which", ["gdn", "ssd"])
def test_an_operator_contest_without_transformers_measures_the_reference_alone(which, tmp_path):
    """``bench gdn`` / ``bench ssd`` here (no transformers in this environment): the reference
    alone, no goal judged, and the table says where the comparison runs."""
    done = run_command(
        [sys.executable, "-m", "mcore_npu.tools.bench", which, "--quick", "--out", str(tmp_path)],
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / f"{which}.json").read_text())
    assert {r["method"] for r in result["rows"]} == {"reference (chunked)"}
    assert result["goals"] == [] and result["where"] in done.stdout


def test_a_contest_compares_two_calls_side_by_side():
    """The two-method path, with the reference standing in for transformers' function (same
    call, so: equal outputs, both passes measured, two goals, ratios near 1)."""
    import dataclasses

    from mcore_npu.tools.bench import ssd, versus

    contest = dataclasses.replace(
        ssd.CONTEST, theirs_at="mcore_npu.ops.mamba:ssd_reference", quick_tokens=64
    )
    result = versus.measure(contest, quick=True)
    assert result["max_abs_diff"] == 0.0
    assert len(result["rows"]) == 4 and all(r["seconds"] > 0 for r in result["rows"])
    assert [g["kind"] for g in result["goals"]] == ["time", "memory"]
    assert "time ratio" in versus.table(result)
