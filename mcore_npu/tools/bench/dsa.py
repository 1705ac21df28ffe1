"""``mcore-npu bench dsa``: the sparse attention reference against dense masked attention.

CPU, float32, BSND, b = 1, S = 8192 and top-k = 2048 (quick: S = 512, k = 128), 4 query heads, 1
KV head, D = Dv = 64 with a rope part of 16, ``sparse_mode=3``. The indices come from the
``lightning_indexer`` reference (4 indexer heads of 32, random inputs; computed once, outside
what is measured). Both sides run forward + backward into query, key, value and the rope parts:

- ``reference``: ``sparse_attention_reference`` (gathers the selected keys, 128 queries at a time);
- ``dense masked``: plain torch, the ``[S, S]`` keep mask built from the indices, full
  ``[N, S, S]`` scores, ``masked_fill``, softmax, matmul (the mask is built inside the call).

One call each (the full size's reference takes about 20 s on 2 cores, so no repeats): its
wall time and its peak under ``track_allocations``, measured together. The goal (issue 48): the
reference's peak <= 0.35x the dense one's.
"""

from __future__ import annotations

import time

import torch

from mcore_npu.ops.dsa import indexer_reference, sparse_attention_reference
from mcore_npu.tools.bench import goal, markdown_table
from mcore_npu.tools.bench.mask import format_seconds
from mcore_npu.tools.bench.memory import track_allocations

HEADS, KV_HEADS, HEAD_DIM, ROPE_DIM = 4, 1, 64, 16
INDEX_HEADS, INDEX_DIM = 4, 32
FULL, QUICK = (8192, 2048), (512, 128)  # (S, top-k)
PEAK_GOAL = 0.35
GOAL_TEXT = f"reference fwd+bwd peak / dense masked's <= {PEAK_GOAL}"
REFERENCE, DENSE = "reference", "dense masked"
SEED = 0
MIB = 2**20


def inputs(seq: int, top_k: int):
    """``(leaves, indices, upstream)``: query ``[1, S, 4, 64]``, key / value ``[1, S, 1, 64]``,
    query_rope ``[1, S, 4, 16]``, key_rope ``[1, S, 1, 16]``; the indexer's int32
    ``[1, S, 1, k]``; the upstream gradient ``[1, S, 4, 64]``."""
    gen = torch.Generator().manual_seed(SEED + seq)

    def draw(*shape):
        return torch.randn(1, seq, *shape, generator=gen)

    leaves = [
        draw(HEADS, HEAD_DIM),
        draw(KV_HEADS, HEAD_DIM),
        draw(KV_HEADS, HEAD_DIM),
        draw(HEADS, ROPE_DIM),
        draw(KV_HEADS, ROPE_DIM),
    ]
    index_q, index_k, weights = draw(INDEX_HEADS, INDEX_DIM), draw(1, INDEX_DIM), draw(INDEX_HEADS)
    indices, _ = indexer_reference(index_q, index_k, weights, sparse_count=top_k)
    return leaves, indices, draw(HEADS, HEAD_DIM)


def scale() -> float:
    return (HEAD_DIM + ROPE_DIM) ** -0.5


def sparse(leaves, indices):
    """The reference: ``[1, S, 4, 64]``."""
    q, k, v, qr, kr = leaves
    return sparse_attention_reference(q, k, v, indices, scale(), query_rope=qr, key_rope=kr)[0]


def dense(leaves, indices):
    """Dense masked attention in plain torch (one KV head): ``[1, S, 4, 64]``."""
    q, k, v, qr, kr = leaves
    seq = q.shape[1]
    rows = indices[0, :, 0].long()  # [S, k], -1 = none
    keep = torch.zeros(seq, seq + 1, dtype=torch.bool)  # column S collects the -1 entries
    keep.scatter_(1, rows.where(rows >= 0, seq), True)
    keep = keep[:, :seq]
    scores = torch.einsum("snd,td->nst", q[0], k[0, :, 0]) + torch.einsum(
        "snd,td->nst", qr[0], kr[0, :, 0]
    )  # [N, S, S]
    probs = torch.softmax((scores * scale()).masked_fill(~keep, float("-inf")), dim=-1)
    return torch.einsum("nst,td->snd", probs, v[0, :, 0])[None]


METHODS = {REFERENCE: sparse, DENSE: dense}


def _forward_backward(method, leaves, indices, upstream) -> torch.Tensor:
    """``method``'s output, its backward run into ``leaves``."""
    out = method(leaves, indices)
    out.backward(upstream)
    return out.detach()


def measure(quick: bool = False) -> dict:
    seq, top_k = QUICK if quick else FULL
    leaves, indices, upstream = inputs(seq, top_k)
    rows, outputs = [], {}
    for name, method in METHODS.items():
        fresh = [t.clone().requires_grad_() for t in leaves]
        with track_allocations() as usage:
            start = time.perf_counter()
            outputs[name] = _forward_backward(method, fresh, indices, upstream)
            seconds = time.perf_counter() - start
        rows.append(
            {
                "S": seq,
                "top_k": top_k,
                "method": name,
                "seconds": seconds,
                "peak_bytes": usage.peak_bytes,
            }
        )
    cell = {r["method"]: r for r in rows}
    peak = cell[REFERENCE]["peak_bytes"] / cell[DENSE]["peak_bytes"]
    speed = cell[REFERENCE]["seconds"] / cell[DENSE]["seconds"]
    return {
        "name": "dsa",
        "title": "DSA sparse attention",
        "setup": (
            f"CPU fp32, BSND, b=1, S={seq}, top-k={top_k}, {HEADS} query heads, "
            f"{KV_HEADS} KV head, D=Dv={HEAD_DIM}, rope {ROPE_DIM}, sparse_mode 3, "
            f"indices from the lightning_indexer reference, forward+backward"
        ),
        "rows": rows,
        "time_ratio": speed,
        "peak_ratio": peak,
        "max_abs_diff": (outputs[REFERENCE] - outputs[DENSE]).abs().max().item(),
        "goals": [goal(GOAL_TEXT, peak, PEAK_GOAL, "memory")],
    }


def table(result: dict) -> str:
    cell = {r["method"]: r for r in result["rows"]}
    body = [
        [name, format_seconds(cell[name]["seconds"]), f"{cell[name]['peak_bytes'] / MIB:.1f}"]
        for name in METHODS
    ]
    body.append(["reference / dense", f"{result['time_ratio']:.3f}", f"{result['peak_ratio']:.3f}"])
    title = (
        f"{result['title']}, {result['setup']}: time of one call and peak bytes allocated "
        f"(max |reference - dense| = {result['max_abs_diff']:.1e}).\n\n"
    )
    return title + markdown_table(["method", "fwd+bwd time", "fwd+bwd peak (MiB)"], body)


def plot(result: dict, path) -> None:
    """Two bar panels: seconds and peak MiB, one bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.5))
    names = [r["method"] for r in result["rows"]]
    left.bar(names, [r["seconds"] for r in result["rows"]])
    right.bar(names, [r["peak_bytes"] / MIB for r in result["rows"]])
    left.set_ylabel("seconds (forward+backward)")
    right.set_ylabel("peak MiB allocated")
    seq = result["rows"][0]["S"]
    left.set_title(f"DSA attention, S={seq}, k={result['rows'][0]['top_k']}")
    right.set_title(f"peak ratio {result['peak_ratio']:.2f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
