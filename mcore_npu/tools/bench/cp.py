"""``mcore-npu bench cp``: one attention layer under context parallelism, per rank.

One ``torchrun --standalone --nproc-per-node 2`` launch of :mod:`.cp_worker` (gloo, CPU, its own
process session, the whole group killed on timeout) measures one causal ``NPUFusionAttention``
layer (reference kernel, sbhd, fp32, GQA 8 / 2 x 64) at S = 16384 (quick: 1024), b = 1, for
CP=1 and for CP=2 with each comm type: per-rank peak bytes, forward and backward
(``track_allocations``); bytes sent per rank (``traffic.count_traffic``) against
:func:`theory_bytes`; host synchronisations per layer (``--layers`` chained layers at a small
S). :func:`floor_bytes` is the fewest bytes a design must hold at the forward's high-water mark.
docs/bench.md derives both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from mcore_npu.tools.bench import goal, markdown_table

SEQ, QUICK_SEQ = 16384, 1024
GOAL_SEQ = SEQ  # S of the peak goals (quick runs report the ratios but judge no peak goal)
SYNC_SEQ, LAYERS = 256, 4
REPEATS, QUICK_REPEATS = 3, 2
SHAPE = {"batch": 1, "heads": 8, "groups": 2, "head_dim": 64}
CP = 2
COMM_TYPES = ("p2p", "all_gather", "a2a")
PEAK_GOAL = 0.55  # per-rank peak at CP=2 over CP=1's, ring (p2p) and a2a, forward and backward
# the CPU reference of the operator: on an NPU, torch_npu runs instead
REFERENCE_KERNEL_FILES = ("mcore_npu/ops/attention_reference.py", "mcore_npu/ops/attention_grad.py")
MEMORY_COLUMNS = (  # (header, phase, figure)
    ("fwd resident peak MiB", "forward", "resident_peak_bytes"),
    ("bwd resident peak MiB", "backward", "resident_peak_bytes"),
    ("fwd transient peak MiB", "forward", "peak_bytes"),
    ("kept for backward MiB", "forward", "retained_bytes"),
    ("bwd transient peak MiB", "backward", "peak_bytes"),
)
TIMEOUT_S = float(os.environ.get("MCORE_NPU_BENCH_CP_TIMEOUT_S", "3600"))
MIB = 2**20


def theory_bytes(comm: str, seq: int, backend: str = "gloo", cp: int = CP, **shape) -> dict:
    """Bytes one rank sends per layer, ``{"forward": n, "backward": n}`` (docs/bench.md)."""
    q, kv = _local_bytes(seq // cp, shape)
    if comm == "p2p":
        return {"forward": (cp - 1) * 2 * kv, "backward": (cp - 1) * 2 * kv + cp * 2 * kv}
    if comm == "all_gather":
        backward = (4 if backend == "gloo" else 2) * (cp - 1) * kv
        return {"forward": 2 * (cp - 1) * kv, "backward": backward}
    if comm == "a2a":
        each = (cp - 1) * (2 * q + 2 * kv) // cp
        return {"forward": each, "backward": each}
    raise ValueError(f"comm: expected one of {', '.join(COMM_TYPES)}, got {comm!r}")


def floor_bytes(comm: str | None, seq: int, cp: int = CP, **shape) -> int:
    """The forward's resident floor of one rank (docs/bench.md); ``comm`` None: CP=1 on the
    whole sequence. ``comm="all_gather"`` has no floor here (no goal covers it)."""
    q, kv = _local_bytes(seq // (1 if comm is None else cp), shape)
    floors = {None: 2 * q + 2 * kv, "p2p": q + 2 * kv + 3 * q // 2, "a2a": 2 * (q + 2 * kv) + q}
    if comm not in floors:
        raise ValueError(f"comm: expected None, 'p2p' or 'a2a' for a floor, got {comm!r}")
    return floors[comm]


def _local_bytes(local: int, shape: dict) -> tuple[int, int]:
    """``(Q, KV)``: float32 bytes of q and of k over ``local`` tokens (``shape`` over SHAPE)."""
    shape = {**SHAPE, **shape}
    per_head = shape["batch"] * local * shape["head_dim"] * 4
    return per_head * shape["heads"], per_head * shape["groups"]


def launch(seq: int, repeats: int, timeout: float = TIMEOUT_S) -> dict:
    """Run the worker on 2 gloo ranks; return its ``CPBENCH`` record (every rank's results)."""
    shape = [f"--{key.replace('_', '-')}={value}" for key, value in SHAPE.items()]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    worker = ["-m", "mcore_npu.tools.bench.cp_worker", f"--seq={seq}", f"--layers={LAYERS}"]
    cmd = [*torchrun, *worker, f"--sync-seq={SYNC_SEQ}", f"--repeats={repeats}", *shape]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    proc = subprocess.Popen(cmd, **pipes, start_new_session=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"bench cp: no exit after {timeout:.0f}s: {' '.join(cmd)}") from None
    records = [
        line.removeprefix("CPBENCH ") for line in stdout.splitlines() if line.startswith("CPBENCH ")
    ]
    if proc.returncode != 0 or len(records) != 1:
        raise RuntimeError(f"bench cp: exit {proc.returncode}: {' '.join(cmd)}\n{stderr[-3000:]}")
    return json.loads(records[0])


def _pass_row(per_rank: list[list[dict]], phase: str) -> dict:
    """One phase of one configuration from ``per_rank[rank][repeat]`` measurements: each figure
    the worst over ranks and repeats, ``*_best`` the worst rank's best repeat (the repeats differ
    only by when gloo's worker thread frees a message buffer)."""
    sent = sorted({m[phase]["bytes_sent"] for runs in per_rank for m in runs})
    figures = {
        "peak_bytes": lambda m: m[phase]["peak_bytes"],
        "resident_peak_bytes": lambda m: _resident_peak(m, phase),
        "retained_bytes": lambda m: m[phase]["live_bytes"],
    }
    row = {}
    for name, figure in figures.items():
        row[name] = max(figure(m) for runs in per_rank for m in runs)
        row[f"{name}_best"] = max(min(figure(m) for m in runs) for runs in per_rank)
    resident = [[_resident_peak(m, phase) for m in runs] for runs in per_rank]
    row["resident_peak_bytes_per_rank"] = resident
    row["bytes_sent"], row["bytes_sent_values"] = max(sent), sent
    row["calls"] = per_rank[0][0][phase]["calls"]
    return row


def _resident_peak(layer: dict, phase: str) -> int:
    """Bytes the layer holds on the rank at the high-water mark of ``phase``: forward, q/k/v
    plus its peak; backward, q/k/v, what the forward kept (saved tensors, output), dy, its peak."""
    fwd = layer["forward"]
    if phase == "forward":
        return fwd["input_bytes"] + fwd["peak_bytes"]
    bwd = layer["backward"]
    return fwd["input_bytes"] + fwd["live_bytes"] + bwd["input_bytes"] + bwd["peak_bytes"]


def _syncs(records: list[dict], layers: int) -> dict:
    """Host syncs of the chained-layer check, per layer per rank (worst rank), split by site."""
    total = max(r["sync_count"] for r in records)
    kernel = REFERENCE_KERNEL_FILES
    outside = max(
        sum(n for site, n in r["sync_sites"].items() if not site.startswith(kernel))
        for r in records
    )
    sites = sorted({site for r in records for site in r["sync_sites"]})
    per_layer = {
        "per_layer": total / layers,
        "per_layer_outside_reference_kernel": outside / layers,
    }
    return {**per_layer, "sites": sites}


def rows_from(record: dict) -> list[dict]:
    """Rows per configuration: CP=1, then CP=2 per comm type."""
    ranks = record["ranks"]
    layers = record["args"]["layers"]
    seq = record["args"]["seq"]
    rows = []
    for key in ("cp1", *COMM_TYPES):
        per_rank = [r["layers"][key] for r in ranks if key in r["layers"]]
        theory = {"forward": 0, "backward": 0} if key == "cp1" else theory_bytes(key, seq)
        cp, comm = (1, None) if key == "cp1" else (CP, key)
        row = {"S": seq, "cp": cp, "comm": comm, "ranks": len(per_rank)}
        for phase in ("forward", "backward"):
            row[phase] = {**_pass_row(per_rank, phase), "theory_bytes": theory[phase]}
            if key == "all_gather":
                row[phase]["theory_bytes_reduce_scatter"] = theory_bytes(key, seq, "hccl")[phase]
        row["sync"] = _syncs([r["sync"][key] for r in ranks if key in r["sync"]], layers)
        rows.append(row)
    base = rows[0]
    for row in rows:
        if row["comm"] != "all_gather":
            floor = floor_bytes(row["comm"], seq)
            cp1 = base["forward"]["resident_peak_bytes"]
            row["forward"].update(floor_bytes=floor, floor_over_cp1=floor / cp1)
        for phase in ("forward", "backward"):
            for figure in ("resident_peak_bytes", "peak_bytes", "retained_bytes"):
                for suffix in ("", "_best"):
                    cp1 = base[phase][figure + suffix]
                    ratio = row[phase][figure + suffix] / cp1 if cp1 else None
                    row[phase][figure.replace("_bytes", "_over_cp1") + suffix] = ratio
    return rows


def measure(quick: bool = False) -> dict:
    seq = QUICK_SEQ if quick else SEQ
    record = launch(seq, QUICK_REPEATS if quick else REPEATS)
    rows = rows_from(record)
    by = {row["comm"]: row for row in rows}
    goals = []
    if seq == GOAL_SEQ:
        for comm in ("p2p", "a2a"):
            for phase in ("forward", "backward"):
                text = f"{comm} CP=2 / CP=1 per-rank {phase} peak (resident) at S={seq}"
                ratio = by[comm][phase]["resident_peak_over_cp1"]
                goals.append(goal(text, ratio, PEAK_GOAL, "memory"))
    worst = max(row["sync"]["per_layer_outside_reference_kernel"] for row in rows)
    text = (
        "host syncs per layer and rank, sbhd, CP=1 and CP=2 (every comm type), "
        "outside the CPU reference kernel"
    )
    goals.append(goal(text, worst, 0.0, "memory"))
    positive = [r["positive_control_syncs"] for r in record["ranks"]]
    return {
        "name": "cp",
        "setup": f"one causal NPUFusionAttention layer, reference kernel, sbhd, CPU fp32, "
        f"b={SHAPE['batch']}, {SHAPE['heads']} query heads / {SHAPE['groups']} KV groups x "
        f"{SHAPE['head_dim']}, S={seq}; 2 gloo ranks under torchrun (CP=1 on rank 0 alone); "
        f"host syncs over {LAYERS} chained layers at S={SYNC_SEQ}",
        "shape": {**SHAPE, "S": seq, "cp": CP, "dtype": "float32", "causal": True},
        "rows": rows,
        "repeats": record["args"]["repeats"],
        "sync_check": {"layers": LAYERS, "S": SYNC_SEQ, "positive_control_syncs": positive},
        "goals": goals,
    }


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _mib(value: int) -> str:
    return f"{value / MIB:.1f}"


def _name(row: dict) -> str:
    return "CP=1" if row["cp"] == 1 else f"CP={row['cp']} {row['comm']}"


def _cells(phase: dict, figure: str) -> list[str]:
    """``[MiB, ratio to CP=1]``, each as ``worst (best)`` when the repeats differ."""
    ratio = figure.replace("_bytes", "_over_cp1")
    worst, best = phase[figure], phase[figure + "_best"]
    if worst == best:
        return [_mib(worst), _ratio(phase[ratio])]
    return [
        f"{_mib(worst)} ({_mib(best)})",
        f"{_ratio(phase[ratio])} ({_ratio(phase[ratio + '_best'])})",
    ]


def memory_table(result: dict) -> str:
    """Markdown: per configuration, resident peak, transient peak and retained bytes."""
    headers = ["config", *(h for header, _, _ in MEMORY_COLUMNS for h in (header, "/ CP=1"))]
    body = []
    for row in result["rows"]:
        cells = [cell for _, phase, figure in MEMORY_COLUMNS for cell in _cells(row[phase], figure)]
        body.append([_name(row), *cells])
    return markdown_table(headers, body)


def floors_text(result: dict) -> str:
    """One sentence: each design's forward floor against CP=1's peak."""
    parts = [
        f"{_name(row)} {_mib(row['forward']['floor_bytes'])} MiB = "
        f"{_ratio(row['forward']['floor_over_cp1'])}"
        for row in result["rows"]
        if "floor_bytes" in row["forward"]
    ]
    return (
        "Forward resident floors (the fewest bytes the design can hold at its high-water mark, "
        "whatever the schedule: docs/bench.md), over CP=1's measured peak: "
        + "; ".join(parts)
        + "."
    )


def traffic_table(result: dict) -> str:
    """Markdown: per configuration, bytes sent per rank and layer vs theory, host syncs."""
    syncs = "host syncs / layer: all (outside the CPU reference kernel)"
    headers = ["config", "fwd sent MiB (theory)", "bwd sent MiB (theory)", syncs]
    body = []
    for row in result["rows"]:
        cells = [_name(row)]
        for phase in (row["forward"], row["backward"]):
            text = f"{phase['bytes_sent'] / MIB:.2f} ({phase['theory_bytes'] / MIB:.2f})"
            if "theory_bytes_reduce_scatter" in phase:
                text += f"; HCCL reduce-scatter: {phase['theory_bytes_reduce_scatter'] / MIB:.2f}"
            cells.append(text)
        sync = row["sync"]
        cells.append(f"{sync['per_layer']:g} ({sync['per_layer_outside_reference_kernel']:g})")
        body.append(cells)
    return markdown_table(headers, body)


def table(result: dict) -> str:
    """Both tables: memory per rank, then traffic and host syncs."""
    return (
        "Per rank (worst rank), one layer. Resident peak: the layer's inputs (forward: q/k/v; "
        "backward: q/k/v, what the forward kept, dy) plus the pass's transient peak (bytes "
        "allocated inside it and alive at once). Each layer was measured "
        f"{result.get('repeats', 1)} times: `worst (best)` where the repeats differ (when gloo's "
        "worker thread frees a message buffer varies).\n\n"
        + memory_table(result)
        + "\n\n"
        + floors_text(result)
        + "\n\nBytes sent per rank and layer, measured (theory), and host synchronisations:\n\n"
        + traffic_table(result)
    )


def plot(result: dict, path) -> None:
    """Two panels: per-rank peak (forward, backward) and bytes sent vs theory, per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = ["CP=1" if r["cp"] == 1 else f"CP=2\n{r['comm']}" for r in rows]
    xs = range(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.38
    sides = ((-width / 2, "forward"), (width / 2, "backward"))
    for offset, phase in sides:
        peaks = [r[phase]["resident_peak_bytes"] / MIB for r in rows]
        left.bar([x + offset for x in xs], peaks, width, label=phase)
    for phase, style in (("forward", "--"), ("backward", ":")):
        limit = PEAK_GOAL * rows[0][phase]["resident_peak_bytes"] / MIB
        label = f"goal: {PEAK_GOAL} x CP=1 {phase}"
        left.axhline(limit, color="gray", linestyle=style, linewidth=0.8, label=label)
    floors = [
        (x, r["forward"]["floor_bytes"] / MIB)
        for x, r in zip(xs, rows)
        if "floor_bytes" in r["forward"]
    ]
    tick = {"marker": "_", "color": "black", "zorder": 3}
    label = "forward floor of the design"
    left.scatter(
        [x - width / 2 for x, _ in floors], [f for _, f in floors], s=300, **tick, label=label
    )
    left.set_xticks(list(xs), names)
    left.set(ylabel="MiB", title=f"per-rank resident peak of one layer, S={result['shape']['S']}")
    left.legend(fontsize=7)
    for offset, phase in sides:
        at = [x + offset for x in xs]
        right.bar(
            at, [r[phase]["bytes_sent"] / MIB for r in rows], width, label=f"{phase} measured"
        )
        right.scatter(at, [r[phase]["theory_bytes"] / MIB for r in rows], s=400, **tick)
    right.scatter([], [], marker="_", color="black", label="theory (gloo)")
    right.set_xticks(list(xs), names)
    right.set(ylabel="MiB", title="bytes sent per rank and layer")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
