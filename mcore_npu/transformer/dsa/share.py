"""Top-k sharing between DSA layers (Megatron 0.19's ``dsa_indexer_topk_freq``, GLM-5's
``indexer_types: shared``): a layer without an indexer attends to the keys an earlier layer of
the same model chose in the same forward."""

from __future__ import annotations

from collections.abc import Iterator

import torch


class TopKShare:
    """The chosen key indices (int32 ``[.., 1, K]``) of each layer that runs its indexer, one
    entry per attention call of its last forward (two per layer for sbhd under CP), for the
    later layers that reuse them. One per spec, as the spec's ``SeqLengthsMemo``."""

    def __init__(self) -> None:
        self._chosen: dict[int, list[torch.Tensor]] = {}

    def start(self, layer_number: int) -> None:
        """A forward of ``layer_number`` begins: its earlier choices go."""
        self._chosen[layer_number] = []

    def put(self, layer_number: int, chosen: torch.Tensor) -> None:
        self._chosen[layer_number].append(chosen)

    def calls(self, source: int, layer_number: int) -> Iterator[torch.Tensor]:
        """``source``'s choices, call by call, for ``layer_number``; RuntimeError where
        ``source`` has not run (it must be a DSA layer of the same model and pipeline stage)."""
        if source not in self._chosen:
            raise RuntimeError(
                f"DSA layer {layer_number} reuses the top-k of layer {source}, which has not run "
                "in this model's forward; with dsa_indexer_topk_freq > 1 every layer a shared "
                "one reads from must be a DSA layer of the same model and pipeline stage"
            )
        return iter(self._chosen[source])
