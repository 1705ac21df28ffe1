"""Megatron 0.16.1's checkpoint splits of the GDN layer (``GatedDeltaNet.sharded_state_dict``).

``in_proj.weight`` is stored as ``in_proj.weight.{query,key,value,z,beta,alpha}`` and
``conv1d.weight`` as ``conv1d.weight.{query,key,value}``, each TP-sharded on its own, so a
checkpoint loads at another TP size."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

IN_PROJ_PARTS = ("query", "key", "value", "z", "beta", "alpha")
CONV_PARTS = ("query", "key", "value")


def split_factory(sharded: ShardedTensor, sections: list[int], names) -> ShardedTensorFactory:
    """A factory that saves ``sharded`` (TP-sharded on axis 0, rows ``sum(sections)``) as one
    sharded tensor per section, keyed ``key.{name}``."""
    template = sharded.without_data()
    if sum(sections) != template.local_shape[0]:
        raise ValueError(
            f"sections: {sections} sum to {sum(sections)}, not the local rows "
            f"{template.local_shape[0]} of {sharded.key}"
        )

    @torch.no_grad()
    def build(key, data, replica_id, flattened_range):
        whole = dataclasses.replace(
            template,
            key=key,
            data=data,
            dtype=data.dtype,
            replica_id=replica_id,
            flattened_range=flattened_range,
        )
        parts, start = [], 0
        for size, name in zip(sections, names, strict=True):
            for part in whole.narrow(0, start, size):
                part.key = f"{part.key}.{name}"
                parts.append(part)
            start += size
        return parts

    @torch.no_grad()
    def merge(loaded):
        return torch.cat(loaded)

    return ShardedTensorFactory(sharded.key, sharded.data, build, merge, sharded.replica_id)
