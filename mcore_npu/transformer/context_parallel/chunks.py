"""Megatron's load-balanced chunk layout under context parallelism, and the collectives on it.

The sequence is cut into 2·CP chunks; CP rank r holds chunks ``r`` and ``2·CP-1-r``
(``get_batch_on_this_cp_rank``). Gathering all ranks' local sequences in rank order gives the chunks
in *rank order* (CP=2: ``[0, 3, 1, 2]``); :func:`natural_index` undoes that."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def chunk_ids(rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks CP rank ``rank`` holds: ``(rank, 2*cp_size - 1 - rank)``."""
    return rank, 2 * cp_size - 1 - rank


def rank_order(cp_size: int) -> list[int]:
    """Chunk ids in rank order: ``[0, 2P-1, 1, 2P-2, ...]`` (CP=2: ``[0, 3, 1, 2]``)."""
    return [c for r in range(cp_size) for c in chunk_ids(r, cp_size)]


def natural_index(cp_size: int, device=None) -> torch.Tensor:
    """Index that turns rank-ordered chunks into natural order: ``natural = x[index]``."""
    order = rank_order(cp_size)
    return torch.tensor([order.index(c) for c in range(2 * cp_size)], device=device)


def rank_index(cp_size: int, device=None) -> torch.Tensor:
    """Index that turns naturally ordered chunks into rank order: ``ranked = x[index]``."""
    return torch.tensor(rank_order(cp_size), device=device)


def reorder_chunks(x: torch.Tensor, index: torch.Tensor, chunks: int) -> torch.Tensor:
    """Permute the ``chunks`` equal chunks of dim 0 of ``x`` by ``index`` (a new tensor)."""
    shape = x.shape
    return x.reshape(chunks, shape[0] // chunks, *shape[1:])[index].reshape(shape)


def all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """``[s_local, ...]`` from every rank -> ``[cp * s_local, ...]`` in rank order."""
    out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
    _gather_single(out, x.contiguous(), group)
    return out


def gather_natural(x: torch.Tensor, group) -> torch.Tensor:
    """``[s_local, ...]`` (chunks r, 2·CP-1-r) from every rank -> ``[cp * s_local, ...]`` in natural
    order. The late chunks go through a half-length buffer: besides the result, half of it is
    allocated."""
    size, half = dist.get_world_size(group), x.shape[0] // 2
    x = x.contiguous()
    out = x.new_empty(size * 2 * half, *x.shape[1:])
    _gather_single(out[: size * half], x[:half], group)
    late = x.new_empty(size, half, *x.shape[1:])
    _gather_single(late.view(size * half, *x.shape[1:]), x[half:], group)
    chunks = out[size * half :].view(size, half, *x.shape[1:])
    for rank in range(size):  # rank r's late chunk is chunk 2·CP-1-r (no flipped copy)
        chunks[size - 1 - rank].copy_(late[rank])
    return out


def _gather_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """``all_gather_single`` (torch 2.13+), else ``all_gather_into_tensor``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """``[cp * s_local, ...]`` summed over ranks; rank r keeps slice r ``[s_local, ...]`` (gloo: an
    all-reduce, then the slice)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    local = x.shape[0] // size
    if dist.get_backend(group) == "gloo":
        total = x.contiguous()
        dist.all_reduce(total, group=group)
        return total[rank * local : (rank + 1) * local].clone()
    out = x.new_empty(local, *x.shape[1:])
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``[cp, ...]`` -> ``[cp, ...]``: slice i goes to rank i; slice j received from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous like x (empty_like keeps a permuted input's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def ring_exchange(tensors: Sequence[torch.Tensor], group) -> list[torch.Tensor]:
    """Send each of ``tensors`` to the next CP rank; receive the previous rank's tensors of the same
    shapes (one batch of messages)."""
    return RingTransfer(tensors, group).wait()


class RingTransfer:
    """:func:`ring_exchange` started now and finished by :meth:`wait` (overlapping the current
    block's attention); the sent tensors must stay unchanged until then."""

    def __init__(self, tensors: Sequence[torch.Tensor], group) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        send_to = dist.get_global_rank(group, (rank + 1) % size)
        recv_from = dist.get_global_rank(group, (rank - 1) % size)
        sent = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, send_to, group) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, recv_from, group) for t in self.received]
        self._requests = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for request in self._requests:
            request.wait()
        return self.received


def planned(memo, key: tuple, build):
    """``memo.plan(key, build)`` (built once per batch layout), or ``build()`` without a memo."""
    return build() if memo is None else memo.plan(key, build)
