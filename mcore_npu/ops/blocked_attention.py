"""Exact attention and its softmax statistics in one blocked pass: the statistics path.

Ring attention (context parallelism) needs, per block pair, the output **and** the operator's
outputs 1 and 2: ``softmax_max`` (row max of the scaled, masked scores) and ``softmax_sum``
(``sum exp(score - max)``). PyTorch's fused CPU kernel gives the output and the log-sum-exp but
not the max, and recomputing the max costs another ``Q @ K^T``. This module computes all three
from one score block per group of query rows, with the flops of the fused kernel:

    scores = scale * Q_blk @ K^T      one GEMM (scale applied to the product, as the operator)
    diagonal square masked (causal)   key j > row i -> -inf; blocks above the diagonal skipped
    softmax_max = rowmax(scores)
    P = softmax(scores)               in place, in the score buffer
    softmax_sum = 1 / rowmax(P)       P at the argmax is exp(0) / sum
    out = P @ V                       one GEMM

Blocks are ``BLOCK_ROWS`` query rows of as many KV heads (with their GQA query heads) as fit the
score budget (``BLOCK_BYTES``, at most half the output's size); score buffers are reused by every
block, so the memory beyond the output and the statistics is that budget. The output is
allocated in the query's memory order, so turning it back into the call's layout (SBH, BSH, ...)
is a view, not a copy.

On the CPU, large problems share their blocks among ``torch.get_num_threads()`` worker threads,
each running single-threaded operators with its own buffers (the budget split among them). One
fused kernel waits at one barrier per call; a few hundred small multi-threaded operators wait at
a few hundred, and on a machine shared with other processes each barrier can cost a scheduler
time slice: measured on the 2-core machine under load, 4-13x SDPA's time inline, about 1.3x with
the workers.

Covers full attention and top-left causal attention (sparse modes 0/1 without a mask, 2, and 3/4
where they reduce to it), without ``pse`` and without dropout, for any layout, GQA, Dv <= D, on
any device. Computed under ``no_grad`` in float32 (float64 for float64 inputs); the reference
takes another path when autograd must record the output.
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
    """Softmax attention with the operator's statistics; no row may be without keys (Skv > 0).

    Args:
        q: ``[B, Nq, Sq, D]`` (any strides, e.g. a view of an SBH tensor).
        k: ``[B, Nkv, Skv, D]``, v: ``[B, Nkv, Skv, Dv]``; Nq % Nkv == 0 (query head i reads
            KV head i // (Nq/Nkv)).
        causal: top-left causal (query i sees keys j <= i), else full attention.
        scale: multiplies ``Q @ K^T``.

    Returns:
        ``(out, softmax_max, softmax_sum)``: out ``[B, Nq, Sq, Dv]`` in q's dtype (memory in q's
        dimension order); the statistics float32 ``[B, Nq, Sq, 8]`` (the value repeated 8 times).
    """
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
    task = _Task(q, k, v, causal, scale, (heads, rows, width),
                 (out.view(batch, heads_kv, group, seq_q, head_dim_v), row_max, inv_sum))  # fmt: skip
    blocks = [(b, h0, min(heads_kv, h0 + heads), start)  # the widest (causal: last) rows first
              for b in range(batch) for h0 in range(0, heads_kv, heads)
              for start in reversed(range(0, seq_q, rows))]  # fmt: skip
    _run_blocks(task, blocks, [task.workspace() for _ in range(max(1, min(workers, len(blocks))))])
    expand = (batch, heads_q, seq_q, 8)
    return (
        out,
        row_max.view(batch, heads_q, seq_q).float().unsqueeze(-1).expand(expand).contiguous(),
        inv_sum.reciprocal_().view(batch, heads_q, seq_q).float().unsqueeze(-1).expand(expand)
        .contiguous(),
    )  # fmt: skip


class _Task:
    """One call: inputs in the compute dtype, the block shape ``(kv heads, rows, widest row)``,
    and the results ``outs = (out [B, Nkv, G, Sq, Dv], max [B, Nkv, G, Sq], 1/sum [B, Nkv, G,
    Sq])``, which the workers fill in disjoint blocks.
    """

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
        g = self.group
        return (self.q[b, h0 * g : h1 * g], self.k[b, h0:h1], self.v[b, h0:h1],
                *(x[b, h0:h1] for x in self.outs))  # fmt: skip


def _workers(q: torch.Tensor, scores: int) -> int:
    """Threads to share the blocks: the caller's intra-op thread count for large CPU problems."""
    if q.device.type != "cpu" or scores < PARALLEL_MIN_SCORES:
        return 1
    return max(1, torch.get_num_threads())


def _run_blocks(task: _Task, blocks: list, workspaces: list) -> None:
    """Run the blocks on one thread per workspace, each taking the next block when it is free.

    Each worker runs single-threaded operators (``torch.set_num_threads(1)`` in that thread,
    the caller's count restored when it ends), so no operator waits at a barrier for a thread
    that the OS has descheduled: the blocks are many small operators, and on a loaded machine
    such barriers cost more than the work; a worker that gets less CPU simply takes fewer
    blocks. Grad mode is thread-local: each worker disables it. One workspace: inline.
    """
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
    """One block: ``outs = (out [h, G, r, Dv], max [h, G, r], 1 / sum [h, G, r])`` filled.

    q_block ``[h*G, r, D]``, keys_h / values_h ``[h, Skv, D|Dv]`` (compute dtype).
    """
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
    """``(kv heads, rows)`` per block: BLOCK_ROWS rows of as many heads as fit ``cap`` bytes.

    Where one KV head's BLOCK_ROWS rows do not fit, fewer rows (at least one).
    """
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
