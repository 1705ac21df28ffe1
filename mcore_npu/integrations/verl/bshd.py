"""A bshd micro-batch as the engine's own forward builds it: right-padded, split over CP ranks.

As verl's ``preprocess_bshd_engine``: every row padded on the right to the longest, a multiple of
TP (of ``2 · CP · TP`` under context parallelism), and CP rank ``r`` given chunks ``r`` and
``2·CP - 1 - r`` of every row (Megatron's zigzag). :class:`RightPadded` builds no mask: ``keep``
(**True = real token**) only selects the real positions of the outputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

__all__ = ["RightPadded", "pad_right", "zigzag_positions"]


def zigzag_positions(seq: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """``[seq / cp_size]`` int64: the positions of CP rank ``cp_rank``'s chunks ``r`` and
    ``2·CP - 1 - r`` of a row of ``seq`` tokens (``seq`` a multiple of ``2 · cp_size``)."""
    chunk = seq // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    index = torch.arange(chunk, device=device)
    return torch.cat([index + first, index + second])


class RightPadded:
    """A jagged ``[B, j]`` batch padded on the right to ``[B, S]``, split over CP ranks, and back.

    Args:
        nested: jagged ``[B, j]`` (verl's ``input_ids``).
        tp_size, cp_size, cp_rank: the layout; ``cp_group`` the CP process group (``gather``).

    Attributes:
        lengths: ``[B]`` int64, real tokens per row.
        keep: ``[B, S]`` bool, **True = real token** (False = padding, on the right only).
        positions: ``[B, S]`` int64 position ids ``0 .. S-1`` of every row.
    """

    def __init__(
        self,
        nested: torch.Tensor,
        *,
        tp_size: int = 1,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_group=None,
    ) -> None:
        self.lengths = nested.offsets().diff()
        align = tp_size * cp_size * 2 if cp_size > 1 else tp_size
        seq = int(self.lengths.max().item()) if self.lengths.numel() else 0
        seq += (align - seq % align) % align
        self.batch, self.seq = int(self.lengths.numel()), seq
        index = torch.arange(seq, device=nested.device)
        self.keep = index.unsqueeze(0) < self.lengths.unsqueeze(1)
        self.positions = index.unsqueeze(0).expand(self.batch, seq)
        self.cp_size, self.cp_rank, self.cp_group = cp_size, cp_rank, cp_group
        self._local = None
        if cp_size > 1:
            self._local = zigzag_positions(seq, cp_size, cp_rank, nested.device)

    def pad(self, nested: torch.Tensor, value: float = 0) -> torch.Tensor:
        """Jagged ``[B, j, ...]`` -> dense ``[B, S, ...]``, ``value`` in the padding."""
        size = (self.batch, self.seq, *nested.shape[2:])
        return torch.nested.to_padded_tensor(nested, value, output_size=size)

    def local(self, dense: torch.Tensor) -> torch.Tensor:
        """Dense ``[B, S, ...]`` -> this CP rank's ``[B, S/CP, ...]`` (itself without CP)."""
        return dense if self._local is None else dense.index_select(1, self._local)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's ``[B, S/CP, ...]`` -> ``[B, S, ...]`` from every CP rank's (itself without
        CP). Only this rank's part carries the autograd graph, as in verl's
        ``postprocess_bshd_engine``: each rank's backward reaches its own tokens."""
        if self._local is None:
            return local
        pieces = [torch.empty_like(local) for _ in range(self.cp_size)]
        dist.all_gather(pieces, local.detach().contiguous(), group=self.cp_group)
        pieces[self.cp_rank] = local
        ranks = range(self.cp_size)
        order = torch.cat(
            [zigzag_positions(self.seq, self.cp_size, r, local.device) for r in ranks]
        )
        return torch.cat(pieces, dim=1).index_select(1, torch.argsort(order))

    def unpad(self, dense: torch.Tensor) -> torch.Tensor:
        """Dense ``[B, S, ...]`` -> jagged ``[B, j, ...]`` of the real positions (as verl does)."""
        rows = [dense[i][self.keep[i]] for i in range(self.batch)]
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def pad_right(input_ids: torch.Tensor) -> RightPadded:
    """Padding for ``input_ids`` (jagged) and its CP split, in Megatron's parallel state's
    layout, as verl aligns and splits."""
    cp_size = mpu.get_context_parallel_world_size()
    tp_size = mpu.get_tensor_model_parallel_world_size()
    cp_rank = mpu.get_context_parallel_rank() if cp_size > 1 else 0
    cp_group = mpu.get_context_parallel_group() if cp_size > 1 else None
    return RightPadded(
        input_ids, tp_size=tp_size, cp_size=cp_size, cp_rank=cp_rank, cp_group=cp_group
    )
