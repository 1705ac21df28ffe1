"""``cp_comm_type="p2p"``: ring attention on Megatron's load-balanced layout.

K/V blocks travel around the CP ring. Rank r holds query chunks (r, 2·CP-1-r); at step i it
holds the K/V of rank ``src = (r - i) mod CP`` and makes one operator call:

================  =========================================  ===========================
step              queries -> keys                            operator call
================  =========================================  ===========================
i = 0 (own K/V)   both local chunks -> both local chunks     sparse mode 2 (causal): the
                                                             pair (early, late) is causal
src < r           both chunks -> src's early chunk           mode 0, no mask (full)
src > r           the late chunk -> both of src's chunks     mode 0, no mask (full)
================  =========================================  ===========================

Partial results merge through the operator's statistics (``softmax_max`` m, ``softmax_sum``
l, float32)::

    m = max(m_a, m_b);  w_a = l_a exp(m_a - m);  w_b = l_b exp(m_b - m)
    l = w_a + w_b;      out = (out_a w_a + out_b w_b) / l

The backward pass runs the same ring with the gradient operator (``npu_fusion_attention_grad``
through ``ops.fusion_attention_grad``), given the merged output and the merged statistics, so
each call returns its block's exact share; dK/dV travel with their block and a last hop brings
them home.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_npu.masks import compressed_causal_mask
from mcore_npu.ops import fusion_attention_grad, fusion_attention_with_stats
from mcore_npu.transformer.context_parallel import chunks


def _blocks(rank: int, size: int, step: int, chunk: int):
    """``(query rows, key rows, causal)`` of step ``step`` on rank ``rank`` (local indices)."""
    src = (rank - step) % size
    if step == 0:
        return slice(0, 2 * chunk), slice(0, 2 * chunk), True
    if src < rank:
        return slice(0, 2 * chunk), slice(0, chunk), False
    return slice(chunk, 2 * chunk), slice(0, 2 * chunk), False


def _mask_kwargs(causal: bool, device) -> dict:
    if causal:
        return {"atten_mask": compressed_causal_mask(device), "sparse_mode": 2}
    return {"sparse_mode": 0}


def _stats_to_sbh(stat: torch.Tensor) -> torch.Tensor:
    """``[B, N, Sq, 8]`` -> ``[Sq, B, N, 1]`` (one copy of the repeated value)."""
    return stat[..., 0].permute(2, 0, 1).unsqueeze(-1)


def _stats_from_sbh(stat: torch.Tensor) -> torch.Tensor:
    """``[Sq, B, N, 1]`` -> ``[B, N, Sq, 8]``, the operator's layout."""
    return stat[..., 0].permute(1, 2, 0).unsqueeze(-1).expand(-1, -1, -1, 8).contiguous()


def _merge(acc, rows, out_b, m_b, l_b):
    """Merge a block's ``(out [r, b, n, d] fp32, m, l [r, b, n, 1])`` into ``acc`` at ``rows``."""
    out_a, m_a, l_a = acc[0][rows], acc[1][rows], acc[2][rows]
    m = torch.maximum(m_a, m_b)
    w_a, w_b = l_a * torch.exp(m_a - m), l_b * torch.exp(m_b - m)
    total = w_a + w_b
    acc[0][rows] = (out_a * w_a + out_b * w_b) / total
    acc[1][rows], acc[2][rows] = m, total


class RingAttention(torch.autograd.Function):
    """q ``[2c, b, np*hn]``, k/v ``[2c, b, ng*hn]`` (SBH, local chunks) -> out like q."""

    @staticmethod
    def forward(ctx, q, k, v, group, heads, scale, kernel):
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        chunk = q.shape[0] // 2
        acc = None
        kv = torch.stack([k, v])  # one message per hop: [2, 2c, b, ng*hn]
        k_cur, v_cur = k, v
        for step in range(size):
            rows, keys, causal = _blocks(rank, size, step, chunk)
            out_b, m_b, l_b = fusion_attention_with_stats(
                q[rows], k_cur[keys], v_cur[keys], heads, "SBH", kernel=kernel, scale=scale,
                **_mask_kwargs(causal, q.device),
            )  # fmt: skip
            out_b = out_b.float().unflatten(-1, (heads, -1))  # [r, b, np, hn]
            m_b, l_b = _stats_to_sbh(m_b), _stats_to_sbh(l_b)
            if acc is None:
                acc = [out_b, m_b, l_b]  # step 0 covers every local row
            else:
                _merge(acc, rows, out_b, m_b, l_b)
            if step + 1 < size:
                kv = chunks.ring_exchange(kv, group)
                k_cur, v_cur = kv[0], kv[1]
        out = acc[0].flatten(2).to(q.dtype)
        smax, ssum = _stats_from_sbh(acc[1]), _stats_from_sbh(acc[2])
        ctx.save_for_backward(q, k, v, out, smax, ssum)
        ctx.group, ctx.heads, ctx.scale, ctx.kernel = group, heads, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, smax, ssum = ctx.saved_tensors
        group, heads, scale = ctx.group, ctx.heads, ctx.scale
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        chunk = q.shape[0] // 2
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        for step in range(size):
            rows, keys, causal = _blocks(rank, size, step, chunk)
            dq_b, dk_b, dv_b, _ = fusion_attention_grad(
                q[rows], kv[0][keys], kv[1][keys], dout[rows], heads, "SBH",
                kernel=ctx.kernel, scale_value=scale,
                softmax_max=smax[:, :, rows].contiguous(),
                softmax_sum=ssum[:, :, rows].contiguous(),
                attention_in=out[rows], **_mask_kwargs(causal, q.device),
            )  # fmt: skip
            dq[rows] += dq_b.float()
            dkv[0][keys] += dk_b.float()
            dkv[1][keys] += dv_b.float()
            if step + 1 < size:
                kv = chunks.ring_exchange(kv, group)
            dkv = chunks.ring_exchange(dkv, group)  # travels with its block; the last hop: home
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def attention(
    query, key, value, group, *, heads, scale, causal, kernel, keep_prob=1.0, thd_ends=None,
    window=None,
):  # fmt: skip
    """Ring attention, sbhd: ``[s_local, b, np, hn]`` in, ``[s_local, b, np * hn]`` out.

    Causal attention only, without dropout (the gradient operator cannot replay a dropout mask
    that the reference draws); both are checked by the caller.
    """
    _refuse_thd_or_window(thd_ends, window)
    if not causal or keep_prob != 1.0:
        raise ValueError(
            "cp_comm_type='p2p' runs causal attention without dropout; got "
            f"causal={causal}, keep_prob={keep_prob}. fix: attention_dropout=0, or "
            "cp_comm_type='all_gather'"
        )
    return RingAttention.apply(
        query.flatten(2), key.flatten(2), value.flatten(2), group, heads, scale, kernel
    )


def _refuse_thd_or_window(thd_ends, window) -> None:
    if thd_ends is not None or window is not None:
        raise NotImplementedError(
            f"cp_comm_type='p2p' is built for sbhd without sliding windows (got "
            f"{'packed (thd) sequences' if thd_ends is not None else f'window_size={window}'}); "
            "fix: cp_comm_type='all_gather', or context_parallel_size=1"
        )
