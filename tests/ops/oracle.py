"""A float64 dense oracle of npu_fusion_attention, written from the contract alone.

Independent of mcore_npu: the keep-condition of every sparse mode is evaluated pair by pair in
plain Python, and attention is a masked softmax by definition (no SDPA). Slow, obviously right,
for small shapes only.
"""

from __future__ import annotations

import math

import torch

INT32_MAX = 2147483647


def keeps(mode, i, j, sq, skv, pre, nxt, prefix, masked, band_segment):
    """Whether query i keeps key j in one (batch, head) or TND segment.

    ``masked(i, j)`` reads the dense mask (True = masked out) or is None.
    """
    d = skv - sq
    if mode == 0:
        if masked is None:
            return True  # no mask: full attention, the band is ignored
        return not masked(i, j) and -pre <= j - i <= nxt
    if mode == 1:
        return masked is None or not masked(i, j)
    if mode == 2:
        return j <= i
    if mode == 3:
        return j <= i + d
    if mode == 4:
        return -pre <= (j - i) - d <= nxt
    if mode in (5, 6):
        return j <= i + d or j < prefix
    if mode == 7:
        return (-pre <= (j - i) - d <= nxt) if band_segment else j <= i + d
    if mode == 8:
        return (-pre <= (j - i) - d <= nxt) if band_segment else j <= i
    raise ValueError(mode)


def attend(q, k, v, keep, scale):
    """Masked softmax attention for one head: q [Sq, D], k [Skv, D], v [Skv, Dv], keep [Sq, Skv]."""
    if k.shape[0] == 0:  # no keys: every row invalid
        return q.new_zeros(q.shape[0], v.shape[-1]), torch.zeros(q.shape[0], dtype=torch.bool)
    scores = (q @ k.T) * scale
    scores = scores.masked_fill(~keep, -math.inf)
    valid = keep.any(1)
    row_max = torch.where(valid, scores.max(1).values, torch.zeros_like(valid, dtype=q.dtype))
    weights = torch.exp(scores - row_max[:, None])  # exp(-inf) = 0 at masked positions
    probs = weights / torch.where(valid, weights.sum(1), torch.ones_like(row_max))[:, None]
    return probs @ v, valid


def _head_views(t, layout, heads):
    """Per-(batch, head) [S, D] views of a layout tensor: views[b][h]."""
    if layout == "BSH":
        t = t.unflatten(-1, (heads, -1))  # [B, S, N, D]
        return [[t[b, :, h] for h in range(heads)] for b in range(t.shape[0])]
    if layout == "SBH":
        t = t.unflatten(-1, (heads, -1))  # [S, B, N, D]
        return [[t[:, b, h] for h in range(heads)] for b in range(t.shape[1])]
    if layout == "BSND":
        return [[t[b, :, h] for h in range(heads)] for b in range(t.shape[0])]
    if layout == "BNSD":
        return [[t[b, h] for h in range(heads)] for b in range(t.shape[0])]
    raise ValueError(layout)


def _stack_layout(rows, layout):
    """rows[b][h] = [S, Dv] -> the output in ``layout``."""
    per_batch = [torch.stack(heads) for heads in rows]  # [N, S, Dv]
    bnsd = torch.stack(per_batch)  # [B, N, S, Dv]
    if layout == "BSH":
        return bnsd.transpose(1, 2).flatten(2)
    if layout == "SBH":
        return bnsd.permute(2, 0, 1, 3).flatten(2)
    if layout == "BSND":
        return bnsd.transpose(1, 2)
    return bnsd


def oracle(
    query,
    key,
    value,
    head_num,
    input_layout,
    *,
    atten_mask=None,
    scale=1.0,
    pre_tockens=INT32_MAX,
    next_tockens=INT32_MAX,
    sparse_mode=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    **_ignored,
):
    """Returns ``(out, valid)``: out in the query layout (float64), valid = bool of out's shape
    (False on rows that keep no key)."""
    q, k, v = (t.double() for t in (query, key, value))
    layout = input_layout.upper()
    if layout == "TND":
        return _oracle_tnd(
            q,
            k,
            v,
            head_num,
            atten_mask,
            scale,
            pre_tockens,
            next_tockens,
            sparse_mode,
            prefix,
            actual_seq_qlen,
            actual_seq_kvlen,
        )
    if layout in ("BSH", "SBH"):
        head_dim = q.shape[-1] // head_num
        heads_kv = k.shape[-1] // head_dim
    else:
        heads_kv = k.shape[2 if layout == "BSND" else 1]
    group = head_num // heads_kv
    qv, kv_, vv = (
        _head_views(t, layout, n) for t, n in ((q, head_num), (k, heads_kv), (v, heads_kv))
    )
    rows, valids = [], []
    for b in range(len(qv)):
        out_b, valid_b = [], []
        for h in range(head_num):
            qh, kh, vh = qv[b][h], kv_[b][h // group], vv[b][h // group]
            sq, skv = qh.shape[0], kh.shape[0]
            masked = _dense_reader(atten_mask, b, h) if sparse_mode in (0, 1) else None
            p = None if prefix is None else prefix[b]
            keep = torch.tensor(
                [
                    [
                        keeps(
                            sparse_mode, i, j, sq, skv, pre_tockens, next_tockens, p, masked, False
                        )
                        for j in range(skv)
                    ]
                    for i in range(sq)
                ],
                dtype=torch.bool,
            ).reshape(sq, skv)
            o, valid = attend(qh, kh, vh, keep, scale)
            out_b.append(o)
            valid_b.append(valid[:, None].expand_as(o))
        rows.append(out_b)
        valids.append(valid_b)
    return _stack_layout(rows, layout), _stack_layout(valids, layout)


def _dense_reader(mask, b, h):
    if mask is None:
        return None
    m = mask.bool()
    if m.dim() == 2:
        return lambda i, j: bool(m[i, j])
    return lambda i, j: bool(m[b if m.shape[0] > 1 else 0, h if m.shape[1] > 1 else 0, i, j])


def _oracle_tnd(q, k, v, heads, mask, scale, pre, nxt, mode, prefix, ends_q, ends_kv):
    heads_kv = k.shape[1]
    group = heads // heads_kv
    starts_q, starts_kv = [0, *ends_q[:-1]], [0, *ends_kv[:-1]]
    segments = list(zip(starts_q, ends_q, starts_kv, ends_kv))
    band = None
    if mode == 7:
        band = max((s for s, (a, b, _, _) in enumerate(segments) if b > a), default=None)
    if mode == 8:
        band = min((s for s, (_, _, c, d) in enumerate(segments) if d > c), default=None)
    outs, valids = [], []
    for s, (a, b, c, d) in enumerate(segments):
        sq, skv = b - a, d - c
        if sq == 0:
            continue
        masked = None
        if mask is not None and mode in (0, 1):
            masked = (lambda m: lambda i, j: bool(m[i, j]))(mask.bool())
        p = None if prefix is None else prefix[s]
        keep = torch.tensor(
            [
                [keeps(mode, i, j, sq, skv, pre, nxt, p, masked, s == band) for j in range(skv)]
                for i in range(sq)
            ],
            dtype=torch.bool,
        ).reshape(sq, skv)
        per_head = [
            attend(q[a:b, h], k[c:d, h // group], v[c:d, h // group], keep, scale)
            for h in range(heads)
        ]
        outs.append(torch.stack([o for o, _ in per_head], 1))  # [Sq_s, N, Dv]
        valids.append(torch.stack([val[:, None].expand(sq, v.shape[-1]) for _, val in per_head], 1))
    if not outs:
        empty = torch.zeros(0, heads, v.shape[-1], dtype=torch.float64)
        return empty, empty.bool()
    return torch.cat(outs), torch.cat(valids)
