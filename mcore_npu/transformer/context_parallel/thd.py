"""Packed (thd) batches under context parallelism: Megatron's per-sequence load balancing.

Every packed sequence (padded length divisible by ``2·CP``) is cut into its own ``2·CP`` chunks; CP
rank r keeps chunks ``r`` and ``2·CP-1-r`` of every sequence (CP=2, sequences of 8 and 4 tokens:
rank 0 keeps ``0 1 6 7 8 11``, rank 1 ``2 3 4 5 9 10``), so its local ``cu_seqlens`` is
``cu // CP``. TE's ``thd_get_partitioned_indices`` in plain PyTorch, without host syncs."""

from __future__ import annotations

import torch

__all__ = [
    "check_thd_partitionable",
    "get_thd_batch_on_this_cp_rank",
    "local_cu_seqlens",
    "thd_get_partitioned_indices",
]

_NOT_SPLIT = frozenset({"attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen"})


def thd_get_partitioned_indices(
    cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int
) -> torch.Tensor:
    """The ``[T / world_size]`` int64 token indices CP rank ``rank`` keeps (TE's signature and
    result). ``cu_seqlens``: ``[B + 1]`` padded offsets with the leading 0, each length divisible by
    ``2 * world_size``; ``total_tokens`` may exceed ``cu_seqlens[-1]`` (a tail split like a
    sequence)."""
    _check_args(cu_seqlens, total_tokens, world_size, rank)
    ends = torch.cat([cu_seqlens.long(), cu_seqlens.new_tensor([total_tokens], dtype=torch.long)])
    cu_local = local_cu_seqlens(ends, world_size)  # [B + 2]: the tail is one more sequence
    token = torch.arange(total_tokens // world_size, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_local, token, right=True) - 1  # the sequence of each local token
    start = cu_local[seq]
    half = (cu_local[seq + 1] - start) // 2  # c_i: one chunk of sequence i
    within = token - start  # position among this rank's 2·c_i tokens of sequence i
    chunk = torch.where(within < half, rank, 2 * world_size - 2 - rank)  # late: skip chunk 0's c_i
    return start * world_size + chunk * half + within


def get_thd_batch_on_this_cp_rank(
    batch: dict,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    max_seqlen,
    cp_size: int | None = None,
    cp_rank: int | None = None,
):
    """Megatron's ``get_thd_batch_on_this_cp_rank`` without Transformer Engine.

    ``batch``: name -> ``[1, T, ...]`` packed tensors (``attention_mask``, ``cu_seqlens``,
    ``cu_seqlens_padded``, ``max_seqlen`` pass unsplit); ``cu_seqlens`` / ``cu_seqlens_padded``:
    ``[B + 1]`` real / padded offsets, kept global; ``max_seqlen``: an int or Megatron's ``[1]``
    tensor; ``cp_size`` / ``cp_rank`` default to ``parallel_state``'s. Returns ``(batch,
    packed_seq_params)``: every split tensor ``[1, T / CP, ...]``, and ``PackedSeqParams("thd")``
    with the GLOBAL offsets, as ``NPUFusionAttention`` under CP expects."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    if isinstance(max_seqlen, torch.Tensor):
        max_seqlen = int(max_seqlen.reshape(-1)[0].item())
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
    cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    cp_rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
    if cp_size == 1:
        return dict(batch), params
    split = {k: v for k, v in batch.items() if k not in _NOT_SPLIT and v is not None}
    if not split:
        raise ValueError(f"batch: no tensor to split among {sorted(batch)}")
    total = next(iter(split.values())).shape[1]
    index = thd_get_partitioned_indices(cu_seqlens_padded, total, cp_size, cp_rank)
    local = dict(batch)
    for key, data in split.items():
        if data.dim() < 2 or data.shape[1] != total:
            raise ValueError(
                f"batch[{key!r}]: expected a packed [1, {total}, ...] tensor (tokens on dim 1), "
                f"got shape {list(data.shape)}"
            )
        local[key] = data.index_select(1, index.to(data.device))
    return local, params


def local_cu_seqlens(cu_seqlens: torch.Tensor, world_size: int) -> torch.Tensor:
    """``[B + 1]`` padded cumulative lengths of one CP rank's local batch: ``cu // CP``."""
    return torch.div(cu_seqlens, world_size, rounding_mode="floor")


def check_thd_partitionable(cu_seqlens: torch.Tensor, world_size: int) -> None:
    """Raise ``ValueError`` naming the first sequence whose padded length does not divide by
    ``2 * world_size`` (one device-to-host copy: once per batch)."""
    lengths = cu_seqlens.diff().tolist()
    for i, length in enumerate(lengths):
        if length % (2 * world_size):
            raise ValueError(
                f"cu_seqlens: packed sequence {i} has padded length {length}, which does not "
                f"divide by 2 * context_parallel_size = {2 * world_size}; fix: pad every "
                f"sequence to a multiple of {2 * world_size} (verl pads to tp * cp * 2) and pass "
                "those padded offsets (Megatron's cu_seqlens_q_padded)"
            )


def _check_args(cu_seqlens, total_tokens, world_size, rank) -> None:
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        got = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens)
        raise TypeError(
            f"cu_seqlens: expected a 1-D integer tensor [B + 1] with the leading 0, got {got}"
        )
    if cu_seqlens.is_floating_point():
        raise TypeError(f"cu_seqlens: expected an integer tensor, got {cu_seqlens.dtype}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    if not isinstance(total_tokens, int) or total_tokens < 0 or total_tokens % world_size:
        raise ValueError(
            f"total_tokens: expected a non-negative multiple of world_size={world_size}, got "
            f"{total_tokens!r}; fix: pad the packed batch to a multiple of 2 * CP per sequence"
        )
