"""``mcore-npu bench step``: one training step, NPU spec (reference kernel) vs Megatron's local.

Both trainers are built from ``configs/gpt_tiny.yaml``'s shape in one process and step in turns
(interleaved), so noise hits both alike. Per sequence length: the median step time of each
(after a warm-up step that also allocates the optimizer state), their ratio, and the peak bytes
allocated during one step (``track_allocations``). ``moe_rows`` do the same for 4 experts
(top-2): the NPU spec's grouped experts against Megatron's ``SequentialMLP``
(``fused.grouped_matmul=off``), same router and attention.
"""

from __future__ import annotations

from mcore_npu.tools.bench import goal, markdown_table
from mcore_npu.tools.bench.memory import track_allocations
from mcore_npu.tools.bench.timing import interleaved_medians

BACKENDS = ("npu_fusion", "local")
DENSE_VARIANTS = {backend: [f"attention.backend={backend}"] for backend in BACKENDS}
MOE_MODEL = [
    "attention.backend=npu_fusion",
    "model.num_moe_experts=4",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=128",
    "model.moe_token_dispatcher_type=alltoall",
    "model.moe_router_dtype=fp32",
    "model.moe_aux_loss_coeff=0.01",
]
MOE_VARIANTS = {"grouped": MOE_MODEL, "sequential": [*MOE_MODEL, "fused.grouped_matmul=off"]}
COMMON = ["train.metrics_file=null", "train.progress=false", "model.qk_layernorm=true"]


def _trainers(variants: dict, seq_length: int, steps: int) -> dict:
    """One trainer per variant (name -> its config overrides), all of ``seq_length`` tokens."""
    from mcore_npu.training.config import load_config
    from mcore_npu.training.train import Trainer

    shape = [f"train.seq_length={seq_length}", f"model.max_sequence_length={seq_length}"]
    shape += [f"train.steps={steps}", *COMMON]
    return {name: Trainer(load_config(None, [*extra, *shape])) for name, extra in variants.items()}


def _time_and_peak(trainers: dict, repeats: int) -> tuple[dict, dict]:
    """Median step time and one step's peak bytes of each trainer (interleaved, one run)."""
    for trainer in trainers.values():
        trainer.train_step()  # warm-up: optimizer state, cached masks
    peaks = {}
    for name, trainer in trainers.items():
        with track_allocations() as usage:
            trainer.train_step()
        peaks[name] = usage.peak_bytes
    steps = {name: trainer.train_step for name, trainer in trainers.items()}
    times = interleaved_medians(steps, repeats=repeats, warmup=0)
    return times, peaks


def _rows(variants: dict, lengths, repeats: int) -> list[dict]:
    """Per sequence length: both variants' time and peak and their ratios (first / second)."""
    first, second = variants
    rows = []
    for seq in lengths:
        times, peaks = _time_and_peak(_trainers(variants, seq, steps=repeats + 4), repeats)
        row = {
            "seq_length": seq,
            **{f"{name}_seconds": times[name] for name in variants},
            "time_ratio": times[first] / times[second],
            **{f"{name}_peak_bytes": peaks[name] for name in variants},
            "peak_ratio": peaks[first] / peaks[second],
        }
        rows.append(row)
    return rows


def measure(quick: bool = False) -> dict:
    from mcore_npu.training import runtime

    lengths = (128,) if quick else (128, 512, 1024)
    repeats = 3 if quick else 7
    try:
        rows = _rows(DENSE_VARIANTS, lengths, repeats)
        moe_rows = _rows(MOE_VARIANTS, lengths[:2], repeats)
    finally:
        runtime.shutdown()
    first = rows[0]
    at = f"at S={first['seq_length']}"
    return {
        "name": "step",
        "setup": "gpt_tiny shape (2 layers, hidden 128, 4 heads / 2 kv groups, SwiGLU, RMSNorm, "
        "qk-norm), micro-batch 4, global batch 8, fp32, CPU, reference kernel",
        "rows": rows,
        "moe_setup": "the same shape with 4 experts (top-2, expert width 128, alltoall "
        "dispatcher) in both layers; grouped = NPUGroupedMLP (grouped-matmul reference), "
        "sequential = Megatron's SequentialMLP, same NPU router and attention",
        "moe_rows": moe_rows,
        "goals": [
            goal(f"npu_fusion / local step time {at}", first["time_ratio"], 1.0, "time"),
            goal(f"npu_fusion / local step peak {at}", first["peak_ratio"], 1.0, "memory"),
        ],
    }


def table(result: dict) -> str:
    text = _table(result["rows"], ("npu_fusion", "local"), ("npu_fusion", "local"))
    if not result.get("moe_rows"):
        return text
    moe = _table(result["moe_rows"], ("grouped", "sequential"), ("grouped", "SequentialMLP"))
    return f"{text}\n\nMoE ({result['moe_setup']}):\n\n{moe}"


def _table(rows: list[dict], variants: tuple[str, str], names: tuple[str, str]) -> str:
    """One line per S: both variants' median ms and peak MiB, and their ratios."""
    headers = ["S", *(f"{n} ms" for n in names), "time ratio"]
    headers += [*(f"{n} peak MiB" for n in names), "peak ratio"]
    body = []
    for r in rows:
        ms = [f"{r[f'{v}_seconds'] * 1e3:.1f}" for v in variants]
        mib = [f"{r[f'{v}_peak_bytes'] / 2**20:.1f}" for v in variants]
        body.append(
            [r["seq_length"], *ms, f"{r['time_ratio']:.2f}x", *mib, f"{r['peak_ratio']:.2f}x"]
        )
    return markdown_table(headers, body)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = [r["seq_length"] for r in result["rows"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(seqs, [r["time_ratio"] for r in result["rows"]], marker="o")
    left.axhline(1.0, color="grey", linestyle=":")
    left.set(xlabel="sequence length", ylabel="npu_fusion / local", title="step time")
    mib = {v: [r[f"{v}_peak_bytes"] / 2**20 for r in result["rows"]] for v in BACKENDS}
    right.plot(seqs, mib["npu_fusion"], marker="o", label="npu_fusion (reference kernel)")
    right.plot(seqs, mib["local"], marker="s", label="Megatron local")
    right.set(xlabel="sequence length", ylabel="MiB", title="peak bytes in one step")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
