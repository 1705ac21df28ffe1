"""``cp_comm_type="all_gather"``: all-gather K/V, each local query chunk attends to its prefix.

Per rank: the local queries (chunks r and 2·CP-1-r), the whole K/V in natural token order.
Query chunk c attends to ``K/V[: (c + 1) * chunk]`` with sparse mode 3 (bottom-right causal,
the compressed mask: no S×S mask). The gather is an autograd function whose backward puts the
K/V gradients back in rank order and reduce-scatters them to their owners.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_npu.masks import compressed_causal_mask
from mcore_npu.ops import fusion_attention
from mcore_npu.transformer.context_parallel import chunks


class GatherSequence(torch.autograd.Function):
    """``[s_local, ...]`` -> ``[s, ...]`` in natural token order; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        gathered = chunks.all_gather_seq(x, group)  # rank order
        return chunks.reorder_chunks(gathered, chunks.natural_index(size, x.device), 2 * size)

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        ranked = chunks.reorder_chunks(grad, chunks.rank_index(size, grad.device), 2 * size)
        return chunks.reduce_scatter_seq(ranked, ctx.group), None


def attention(query, key, value, group, *, heads, scale, causal, kernel, keep_prob=1.0):
    """Context-parallel attention by all-gather, sbhd.

    Args:
        query: ``[s_local, b, np, hn]``, key/value ``[s_local, b, ng, hn]`` (local chunks).
        group: the CP process group; heads: np; causal: top-left causal over the whole
            sequence (else full attention).

    Returns:
        ``[s_local, b, np * hn]``.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    k = GatherSequence.apply(key, group).flatten(2)  # [s, b, ng*hn], natural order
    v = GatherSequence.apply(value, group).flatten(2)
    q = query.flatten(2)
    common = dict(kernel=kernel, scale=scale, keep_prob=keep_prob)
    if not causal:
        return fusion_attention(q, k, v, heads, "SBH", **common)
    chunk = query.shape[0] // 2
    mask = compressed_causal_mask(query.device)
    outs = []
    for half, chunk_id in enumerate(chunks.chunk_ids(rank, size)):
        end = (chunk_id + 1) * chunk  # keys this chunk may see: [0, end), bottom-right causal
        q_half = q[half * chunk : (half + 1) * chunk]
        outs.append(
            fusion_attention(
                q_half, k[:end], v[:end], heads, "SBH", atten_mask=mask, sparse_mode=3, **common
            )  # fmt: skip
        )
    return torch.cat(outs)
