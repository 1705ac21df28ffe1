"""Exact attention and its softmax statistics (``softmax_max``, ``softmax_sum``) in one blocked
pass, with the flops of one fused call: what ring attention needs per block pair. Per block of
query rows::

    scores = scale * Q_blk @ K^T      one GEMM; causal: key j > row i -> -inf, blocks above skipped
    softmax_max = rowmax(scores)
    P = softmax(scores)               in place, in the score buffer
    softmax_sum = 1 / rowmax(P)       P at the argmax is exp(0) / sum
    out = P @ V                       one GEMM

Blocks are ``BLOCK_ROWS`` rows of as many KV heads as fit ``BLOCK_BYTES`` (the only memory
beyond the results); large CPU problems share them among worker threads. Full or top-left
causal attention, no ``pse``, no dropout, any layout, GQA, Dv <= D; under ``no_grad`` in float32
(float64 for float64 inputs). Design and measurements: docs/context_parallel.md.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

BLOCK_ROWS = 128
"""Query rows per block (per query head)."""
BLOCK_BYTES = 4 * 2**20
"""Most bytes of score buffers (all workers together); also at most half the output's size,
and at least ``MIN_BLOCK_BYTES``."""
MIN_BLOCK_BYTES = 256 * 2**10
PARALLEL_MIN_SCORES = 2**20
"""Problems with fewer score elements than this run on the calling thread alone."""


@torch.no_grad()
def attention_with_statistics(q, k, v, causal: bool, scale: float):
    """Softmax attention with the operator's statistics (Skv > 0; ``causal`` top-left): q
    ``[B, Nq, Sq, D]`` (any strides), k/v ``[B, Nkv, Skv, D|Dv]`` -> ``(out [B, Nq, Sq, Dv]`` in q's
    dtype and dimension order, ``softmax_max, softmax_sum)`` float32 ``[B, Nq, Sq, 8]``."""
    batch, heads_q, seq_q, _ = q.shape
    heads_kv, seq_kv, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
    group = heads_q // heads_kv
    out = _empty_like_layout(q, head_dim_v)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = (t.to(compute) for t in (q, k, v))  # no copy for float32 / float64 inputs
    width = min(seq_q, seq_kv) if causal else seq_kv  # widest score row of any block
    workers = _workers(q, batch * heads_q * seq_q * width)
    budget = min(BLOCK_BYTES, max(MIN_BLOCK_BYTES, out.numel() * out.element_size() // 2))
    heads, rows = _block_shape(heads_kv, group, seq_q, width, compute.itemsize, budget // workers)
    row_max = q.new_empty(batch, heads_kv, group, seq_q)
    inv_sum = torch.empty_like(row_max)
    outs = (out.view(batch, heads_kv, group, seq_q, head_dim_v), row_max, inv_sum)
    task = _Task(q, k, v, causal, scale, (heads, rows, width), outs)
    starts = list(reversed(range(0, seq_q, rows)))  # the widest (causal: last) rows first
    heads_ranges = [(h0, min(heads_kv, h0 + heads)) for h0 in range(0, heads_kv, heads)]
    blocks = [
        (b, h0, h1, start) for b in range(batch) for h0, h1 in heads_ranges for start in starts
    ]
    _run_blocks(task, blocks, [task.workspace() for _ in range(max(1, min(workers, len(blocks))))])
    expand = (batch, heads_q, seq_q, 8)
    softmax_max = row_max.view(batch, heads_q, seq_q).float()
    softmax_sum = inv_sum.reciprocal_().view(batch, heads_q, seq_q).float()
    return (
        out,
        softmax_max.unsqueeze(-1).expand(expand).contiguous(),
        softmax_sum.unsqueeze(-1).expand(expand).contiguous(),
    )


class _Task:
    """One call: inputs in the compute dtype, the block shape ``(kv heads, rows, widest row)`` and
    the results ``outs`` (out, max, 1/sum, ``[B, Nkv, G, Sq, ...]``) filled in disjoint blocks."""

    def __init__(self, q, k, v, causal, scale, shape, outs):
        self.q, self.k, self.v, self.causal, self.scale, self.outs = q, k, v, causal, scale, outs
        self.heads, self.rows, self.width = shape
        self.group = q.shape[1] // k.shape[1]
        self.diagonal = torch.ones(self.rows, self.rows, dtype=torch.bool, device=q.device)
        self.diagonal.triu_(1)  # True = masked: key j > row i of the diagonal square
        self.zero = q.new_zeros(())

    def workspace(self):
        """One worker's buffers (allocated by the caller, so allocation trackers see them):
        scores ``[h*G*r*width]``, the GQA query copy ``[h*G*r*D]`` (None for MHA), the block
        output ``[h*G*r*Dv]``."""
        n = self.heads * self.group * self.rows
        q_copy = self.q.new_empty(n * self.q.shape[-1]) if self.group > 1 else None
        return self.q.new_empty(n * self.width), q_copy, self.q.new_empty(n * self.v.shape[-1])

    def run(self, blocks, workspace) -> None:
        """Compute ``blocks`` ``(b, h0, h1, start)`` in order, in ``workspace``."""
        key, views = None, None
        for b, h0, h1, start in blocks:
            if key != (b, h0):  # one head group's views, made once per group
                key, views = (b, h0), self._group_views(b, h0, h1)
            q_h, k_h, v_h, out_h, max_h, inv_sum_h = views
            stop = start + self.rows
            outs = (out_h[:, :, start:stop], max_h[..., start:stop], inv_sum_h[..., start:stop])
            _attend_block(self, q_h[:, start:stop], k_h, v_h, start, workspace, outs)

    def _group_views(self, b, h0, h1):
        """q ``[h*G, Sq, D]``, k / v ``[h, Skv, D|Dv]`` and the results of KV heads h0:h1."""
        g, results = self.group, (x[b, h0:h1] for x in self.outs)
        return (self.q[b, h0 * g : h1 * g], self.k[b, h0:h1], self.v[b, h0:h1], *results)


def _workers(q: torch.Tensor, scores: int) -> int:
    """Threads to share the blocks: the caller's intra-op thread count for large CPU problems."""
    if q.device.type != "cpu" or scores < PARALLEL_MIN_SCORES:
        return 1
    return max(1, torch.get_num_threads())


def _run_blocks(task: _Task, blocks: list, workspaces: list) -> None:
    """Run the blocks on one thread per workspace (one: inline), each taking the next block.
    Workers run single-threaded operators (no barrier waits for a descheduled thread, the caller's
    count restored after) and disable grad mode (thread-local)."""
    if len(workspaces) <= 1:
        task.run(blocks, workspaces[0])
        return
    caller_threads = torch.get_num_threads()
    pending, lock = iter(blocks), threading.Lock()

    def take():
        while True:
            with lock:
                block = next(pending, None)
            if block is None:
                return
            yield block

    def work(workspace):
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                task.run(take(), workspace)
        finally:
            torch.set_num_threads(caller_threads)

    with ThreadPoolExecutor(len(workspaces), thread_name_prefix="mcore-npu-attention") as pool:
        for future in [pool.submit(work, w) for w in workspaces]:
            future.result()


def _attend_block(task, q_block, keys_h, values_h, start, workspace, outs) -> None:
    """One block: q_block ``[h*G, r, D]``, keys_h / values_h ``[h, Skv, D|Dv]`` -> ``outs =
    (out [h, G, r, Dv], max [h, G, r], 1 / sum [h, G, r])``."""
    out, max_out, inv_sum_out = outs
    scores_buf, q_buf, o_buf = workspace
    heads, group, rows = keys_h.shape[0], task.group, q_block.shape[1]
    keys = min(start + rows, keys_h.shape[1]) if task.causal else keys_h.shape[1]
    if group > 1:  # [h*G, r, D] -> [h, G*r, D]: rows of one KV head's query heads stacked
        q_flat = q_buf[: q_block.numel()].view(heads, group, rows, -1)
        q_block = q_flat.copy_(q_block.view(heads, group, rows, -1))
    q_block = q_block.view(heads, group * rows, -1)
    scores = scores_buf[: heads * group * rows * keys].view(heads, group * rows, keys)
    torch.baddbmm(task.zero, q_block, keys_h[:, :keys].mT, beta=0.0, alpha=task.scale, out=scores)
    scores = scores.view(heads, group, rows, keys)
    if task.causal and start < keys:  # the diagonal square: rows start.., keys start..keys
        scores[..., start:keys].masked_fill_(task.diagonal[:rows, : keys - start], float("-inf"))
    torch.amax(scores, -1, out=max_out)
    probs = _softmax_in_place(scores)
    torch.amax(probs, -1, out=inv_sum_out)  # exp(0) / sum at the argmax
    o = o_buf[: heads * group * rows * out.shape[-1]].view(heads, group * rows, -1)
    torch.bmm(probs.view(heads, group * rows, keys), values_h[:, :keys], out=o)
    out.copy_(o.view(out.shape))


def _softmax_in_place(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, written over ``scores`` on the CPU (its row-wise kernel reads
    each row before writing it); a new tensor elsewhere."""
    if scores.device.type == "cpu":
        return torch.ops.aten._softmax.out(scores, -1, False, out=scores)
    return torch.softmax(scores, -1)


def _block_shape(heads_kv: int, group: int, seq_q: int, width: int, itemsize: int, cap: int):
    """``(kv heads, rows)`` per block: BLOCK_ROWS rows of as many heads as fit ``cap`` bytes (fewer
    rows, at least one, where one head's do not fit)."""
    rows = max(1, min(seq_q, BLOCK_ROWS))
    per_head = group * rows * max(width, 1) * itemsize
    if per_head > cap:
        return 1, max(1, min(rows, cap // (group * max(width, 1) * itemsize)))
    return max(1, min(heads_kv, cap // per_head)), rows


def _empty_like_layout(q: torch.Tensor, head_dim_v: int) -> torch.Tensor:
    """An empty ``[B, N, S, Dv]`` tensor whose memory orders B, N, S as q's strides do."""
    order = sorted(range(3), key=lambda d: -q.stride(d))  # outermost first; ties keep B, N, S
    shape = (*q.shape[:3], head_dim_v)
    return torch.empty_permuted(shape, (*order, 3), dtype=q.dtype, device=q.device)
