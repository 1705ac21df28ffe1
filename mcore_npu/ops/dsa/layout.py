"""What the DSA operators share: their layouts (``BSND``, packed ``TND``), per-sequence
segments, argument checks and limits (see the package doc)."""

from __future__ import annotations

import torch

from mcore_npu.ops._checks import describe, fail, is_int

INDEXER = "lightning_indexer"
ATTENTION = "sparse_flash_attention"
LAYOUTS = ("BSND", "TND")
SPARSE_MODES = (0, 3)
QUERY_BLOCK = 128
INDEXER_HEAD_DIM, INDEXER_MAX_HEADS = 128, 64  # the fused indexer's limits (one key head)
SFA_HEAD_DIM, SFA_ROPE_DIM = 512, 64  # the fused attention's limits (attention_mode=2)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def device_of(t):
    return getattr(t, "device", torch.device("cpu"))


# ---------------------------------------------------------------------------------------- layout


def segments(op, layout, tensor, lengths, argument, shown):
    """``[(batch, start, length)]``: the sequences of ``tensor`` in ``layout`` (see the module
    docstring for what ``lengths`` means in each)."""
    if lengths is None:
        if layout == "BSND":
            return [(b, 0, tensor.shape[1]) for b in range(tensor.shape[0])]
        return [(0, 0, tensor.shape[0])]
    values = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    if not values or not all(is_int(v) for v in values):
        fail(
            op,
            TypeError,
            argument,
            f"expected a list or 1-D tensor of ints, got {values!r}",
            "pass the lengths as ints",
            shown,
        )
    if layout == "BSND":
        if len(values) != tensor.shape[0] or any(v < 0 or v > tensor.shape[1] for v in values):
            fail(
                op,
                ValueError,
                argument,
                f"{values} is not one length in [0, {tensor.shape[1]}] per batch "
                f"({tensor.shape[0]})",
                "pass each batch's valid token count (BSND)",
                shown,
            )
        return [(b, 0, n) for b, n in enumerate(values)]
    ends = [0, *values]
    if any(b < a for a, b in zip(ends, ends[1:])) or values[-1] != tensor.shape[0]:
        fail(
            op,
            ValueError,
            argument,
            f"{values} are not non-decreasing cumulative ends reaching T = {tensor.shape[0]}",
            "pass cu_seqlens[1:] (TND lengths are cumulative, no leading 0)",
            shown,
        )
    return [(0, a, b - a) for a, b in zip(ends, ends[1:])]


def sequence(t, layout, batch, start, length):
    """The ``[length, N, D]`` tokens of one sequence."""
    return t[batch, :length] if layout == "BSND" else t[start : start + length]


def check_choice(op, argument, value, allowed, shown):
    if value not in allowed:
        fail(
            op,
            ValueError,
            argument,
            f"{value!r} is not one of {list(allowed)}",
            f"pass one of {', '.join(map(repr, allowed))}",
            shown,
        )


def check_same_batch(op, layout, query, key, shown):
    """In ``BSND``, one key sequence per query sequence."""
    if layout == "BSND" and key.shape[0] != query.shape[0]:
        fail(
            op,
            ValueError,
            "key",
            f"batch {key.shape[0]} differs from query's {query.shape[0]}",
            "pass one key sequence per batch",
            shown,
        )


def check_rope_pair(op, query_rope, key_rope, shown):
    """Both rope parts, or neither."""
    if (query_rope is None) != (key_rope is None):
        missing = "key_rope" if key_rope is None else "query_rope"
        fail(
            op,
            ValueError,
            missing,
            "is None while the other rope part is given",
            "pass both query_rope and key_rope, or neither",
            shown,
        )


def check_tensor(op, argument, t, rank, shown, dtypes=_DTYPES):
    if not isinstance(t, torch.Tensor):
        fail(
            op,
            TypeError,
            argument,
            f"expected a torch.Tensor, got {type(t).__name__}",
            "pass a tensor",
            shown,
        )
    if t.dim() != rank:
        fail(
            op,
            ValueError,
            argument,
            f"{t.dim()}-D ({describe(t)}), expected {rank}-D",
            "BSND takes [B, S, N, D] (weights [B, S, N]); TND takes [T, N, D] (weights [T, N])",
            shown,
        )
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        fail(
            op,
            TypeError,
            argument,
            f"dtype {t.dtype} is not supported",
            f"pass one of {names}",
            shown,
        )


def tensor_rank(layout):
    return 4 if layout == "BSND" else 3


# --------------------------------------------------------------------------------------- indexer


def lengths_as_tensors(like, q_lengths, kv_lengths, names):
    """The lengths as the int64 tensors the torch_npu ops take (None stays None)."""

    def convert(v):
        if v is None or isinstance(v, torch.Tensor):
            return v
        return torch.tensor(list(v), dtype=torch.int64, device=like.device)

    return {names[0]: convert(q_lengths), names[1]: convert(kv_lengths)}


# ------------------------------------------------------------------------------------- attention
