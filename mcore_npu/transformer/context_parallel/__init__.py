"""Context parallelism for ``NPUFusionAttention``, one small module per ``cp_comm_type``: ``p2p``
(:mod:`.ring`), ``all_gather`` (:mod:`.all_gather`), ``a2a`` (:mod:`.ulysses`); ``a2a+p2p`` is
refused.

Inputs are Megatron's: CP rank r holds chunks r and 2·CP-1-r of every sequence, sbhd
``[s/CP, b, n, hn]`` or packed thd ``[t/CP, n, hn]`` (every packed sequence cut into its own 2·CP
chunks, :mod:`.thd`). The CP group is ``pg_collection.cp``, else ``parallel_state``'s."""

from __future__ import annotations

from mcore_npu.transformer.context_parallel import all_gather, ring, rules, ulysses
from mcore_npu.transformer.context_parallel.thd import (
    check_thd_partitionable,
    get_thd_batch_on_this_cp_rank,
    local_cu_seqlens,
    thd_get_partitioned_indices,
)

COMM_TYPES = rules.KNOWN
_ALGORITHMS = {"p2p": ring, "all_gather": all_gather, "a2a": ulysses}

__all__ = [
    "COMM_TYPES",
    "attention",
    "check_thd_partitionable",
    "context_parallel_group",
    "get_thd_batch_on_this_cp_rank",
    "layer_comm_type",
    "local_cu_seqlens",
    "thd_get_partitioned_indices",
]


def layer_comm_type(config, layer_number: int, given: str | None) -> str:
    """This layer's comm type: the one Megatron passed, else ``config.cp_comm_type`` (a string or a
    per-layer list, by the 1-based ``layer_number``), else ``"p2p"``."""
    chosen = given
    if chosen is None:
        configured = getattr(config, "cp_comm_type", None)
        if isinstance(configured, (list, tuple)):
            chosen = configured[layer_number - 1]
        else:
            chosen = configured
    chosen = "p2p" if chosen is None else chosen
    rules.check(chosen, config.context_parallel_size, where=f"layer {layer_number}")
    return chosen


def context_parallel_group(pg_collection):
    """``pg_collection.cp`` when present, else Megatron's ``parallel_state`` CP group."""
    group = getattr(pg_collection, "cp", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def attention(comm_type, query, key, value, group, **kwargs):
    """Run ``comm_type``'s algorithm: sbhd ``[s_local, b, np, hn]`` -> ``[s_local, b, np * hn]``,
    thd ``[t_local, np, hn]`` -> ``[t_local, np * hn]``.

    Keywords: ``heads`` (np), ``scale``, ``causal``, ``kernel``, ``keep_prob``, ``thd_ends``
    (packed: local padded cumulative ends without the leading 0, host ints; None for sbhd),
    ``window`` (``(left, right)``, -1 = unbounded) and ``memo`` (the layer's ``SeqLengthsMemo``). A
    case :mod:`.rules` refuses raises ``ContextParallelUnsupported``."""
    return _ALGORITHMS[comm_type].attention(query, key, value, group, **kwargs)
