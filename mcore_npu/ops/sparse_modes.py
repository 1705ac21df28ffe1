"""Every sparse mode as a keep-condition on query index i and key index j (the table and worked
examples: specs/npu_fusion_attention.md).

These functions return **keep** masks: ``True`` = the score is kept (attended to), the polarity
of SDPA and the *negation* of the operator's ``atten_mask`` (True = masked out). The only
Sq x Skv allocation is the bool result. With ``d = Skv - Sq``::

    mode 0   keep iff -pre <= j - i <= next              (and the caller's dense mask keeps it)
    mode 2   keep iff j <= i                             (top-left causal)
    mode 3   keep iff j <= i + d                         (bottom-right causal)
    mode 4   keep iff -pre <= (j - i) - d <= next        (band, bottom-right origin)
    mode 5/6 keep iff j <= i + d  or  j < prefix[b]
"""

from __future__ import annotations

import torch

from mcore_npu.ops.contract import INT32_MAX


def band_keep(
    seq_q: int,
    seq_kv: int,
    pre_tokens: int,
    next_tokens: int,
    *,
    offset: int = 0,
    rows: tuple[int, int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Keep mask of the band ``-pre <= (j - i) - offset <= next`` (offset 0: top-left, ``Skv - Sq``:
    bottom-right): bool ``[stop - start, Skv]`` for ``rows = (start, stop)`` (default all)."""
    start, stop = rows if rows is not None else (0, seq_q)
    i = torch.arange(start, stop, device=device).unsqueeze(1)  # [rows, 1]
    j = torch.arange(seq_kv, device=device)  # [Skv]
    keep = torch.le(j, i + (offset + next_tokens))  # [rows, Skv]
    if pre_tokens - offset < stop - 1:  # else the lower edge cuts nothing
        keep &= torch.ge(j, i + (offset - pre_tokens))
    return keep


def causal_keep(
    seq_q: int,
    seq_kv: int,
    *,
    bottom_right: bool,
    rows: tuple[int, int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Keep mask of causal attention: top-left (mode 2) or bottom-right (mode 3)."""
    offset = seq_kv - seq_q if bottom_right else 0
    return band_keep(seq_q, seq_kv, INT32_MAX, 0, offset=offset, rows=rows, device=device)


def prefix_keep(
    seq_q: int,
    seq_kv: int,
    prefix: list[int] | tuple[int, ...],
    *,
    rows: tuple[int, int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Keep mask of modes 5/6, bottom-right causal or within the first ``prefix[b]`` keys: bool
    ``[B, 1, rows, Skv]``, True = kept."""
    keep = causal_keep(seq_q, seq_kv, bottom_right=True, rows=rows, device=device)
    j = torch.arange(seq_kv, device=device)
    limits = torch.tensor(list(prefix), device=device).view(-1, 1, 1, 1)  # [B, 1, 1, 1]
    return keep | torch.lt(j, limits)  # [B, 1, rows, Skv]


def band_covers_everything(seq_q: int, seq_kv: int, pre: int, nxt: int, offset: int) -> bool:
    """True when ``band_keep`` would keep every (i, j): the band cuts nothing."""
    return nxt + offset >= seq_kv - 1 and pre - offset >= seq_q - 1
