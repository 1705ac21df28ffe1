"""``mcore-npu bench step``: one training step, NPU spec (reference kernel) vs Megatron's local spec.

A second table (``moe_rows``) does the same for the MoE shape of ``configs/gpt_tiny_moe.yaml``
(4 experts, top-2): the NPU spec with its grouped experts (``npu_grouped_matmul`` reference)
against the same NPU spec with Megatron's ``SequentialMLP`` experts (``fused.grouped_matmul=off``:
Megatron's local MoE path; its own router needs Transformer Engine on megatron-core 0.16.1),
both built and stepped in turns in the same run.

Both trainers are built from ``configs/gpt_tiny.yaml``'s shape in one process and step in
turns (interleaved), so noise hits both alike. Reported per sequence length: the median step
time of each (after a warm-up step that also allocates the optimizer state), their ratio, and
the peak bytes allocated during one step (``track_allocations``: activations, gradients, the
optimizer update; the grad buffers and Adam state allocated before the step are not counted).
"""

from __future__ import annotations

from mcore_npu.tools.bench import goal, markdown_table
from mcore_npu.tools.bench.memory import track_allocations
from mcore_npu.tools.bench.timing import interleaved_medians

BACKENDS = ("npu_fusion", "local")
DENSE_VARIANTS = {backend: [f"attention.backend={backend}"] for backend in BACKENDS}
MOE_MODEL = ["attention.backend=npu_fusion", "model.num_moe_experts=4", "model.moe_router_topk=2",
             "model.moe_ffn_hidden_size=128", "model.moe_token_dispatcher_type=alltoall",
             "model.moe_router_dtype=fp32", "model.moe_aux_loss_coeff=0.01"]  # fmt: skip
MOE_VARIANTS = {"grouped": MOE_MODEL, "sequential": [*MOE_MODEL, "fused.grouped_matmul=off"]}
COMMON = ["train.metrics_file=null", "train.progress=false", "model.qk_layernorm=true"]


def _trainers(variants: dict, seq_length: int, steps: int) -> dict:
    """One trainer per variant (name -> its config overrides), all of ``seq_length`` tokens."""
    from mcore_npu.training.config import load_config
    from mcore_npu.training.train import Trainer

    shape = [f"train.seq_length={seq_length}", f"model.max_sequence_length={seq_length}",
             f"train.steps={steps}", *COMMON]  # fmt: skip
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
    times = interleaved_medians({n: t.train_step for n, t in trainers.items()}, repeats=repeats,
                                warmup=0)  # fmt: skip
    return times, peaks


def _rows(variants: dict, lengths, repeats: int) -> list[dict]:
    """Per sequence length: both variants' time and peak and their ratios (first / second)."""
    first, second = variants
    rows = []
    for seq in lengths:
        times, peaks = _time_and_peak(_trainers(variants, seq, steps=repeats + 4), repeats)
        rows.append({
            "seq_length": seq,
            f"{first}_seconds": times[first], f"{second}_seconds": times[second],
            "time_ratio": times[first] / times[second],
            f"{first}_peak_bytes": peaks[first], f"{second}_peak_bytes": peaks[second],
            "peak_ratio": peaks[first] / peaks[second],
        })  # fmt: skip
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
            goal(
                f"npu_fusion / local step time at S={first['seq_length']}",
                first["time_ratio"],
                1.0,
                "time",
            ),
            goal(
                f"npu_fusion / local step peak at S={first['seq_length']}",
                first["peak_ratio"],
                1.0,
                "memory",
            ),
        ],
    }


def table(result: dict) -> str:
    rows = [
        [r["seq_length"], f"{r['npu_fusion_seconds'] * 1e3:.1f}", f"{r['local_seconds'] * 1e3:.1f}",
         f"{r['time_ratio']:.2f}x", f"{r['npu_fusion_peak_bytes'] / 2**20:.1f}",
         f"{r['local_peak_bytes'] / 2**20:.1f}", f"{r['peak_ratio']:.2f}x"]
        for r in result["rows"]
    ]  # fmt: skip
    headers = ["S", "npu_fusion ms", "local ms", "time ratio", "npu_fusion peak MiB",
               "local peak MiB", "peak ratio"]  # fmt: skip
    text = markdown_table(headers, rows)
    if not result.get("moe_rows"):
        return text
    moe = [
        [r["seq_length"], f"{r['grouped_seconds'] * 1e3:.1f}",
         f"{r['sequential_seconds'] * 1e3:.1f}", f"{r['time_ratio']:.2f}x",
         f"{r['grouped_peak_bytes'] / 2**20:.1f}", f"{r['sequential_peak_bytes'] / 2**20:.1f}",
         f"{r['peak_ratio']:.2f}x"]
        for r in result["moe_rows"]
    ]  # fmt: skip
    moe_headers = ["S", "grouped ms", "SequentialMLP ms", "time ratio", "grouped peak MiB",
                   "SequentialMLP peak MiB", "peak ratio"]  # fmt: skip
    return f"{text}\n\nMoE ({result['moe_setup']}):\n\n{markdown_table(moe_headers, moe)}"


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = [r["seq_length"] for r in result["rows"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(seqs, [r["time_ratio"] for r in result["rows"]], marker="o")
    left.axhline(1.0, color="grey", linestyle=":")
    left.set(xlabel="sequence length", ylabel="npu_fusion / local", title="step time")
    right.plot(seqs, [r["npu_fusion_peak_bytes"] / 2**20 for r in result["rows"]], marker="o",
               label="npu_fusion (reference kernel)")  # fmt: skip
    right.plot(seqs, [r["local_peak_bytes"] / 2**20 for r in result["rows"]], marker="s",
               label="Megatron local")  # fmt: skip
    right.set(xlabel="sequence length", ylabel="MiB", title="peak bytes in one step")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
