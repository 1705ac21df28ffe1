"""Context parallelism for ``NPUFusionAttention``, one small module per ``cp_comm_type``.

=============  ===========================================  ==============================
comm type      what travels                                 module
=============  ===========================================  ==============================
``p2p``        K/V blocks around the ring; dK/dV back       :mod:`.ring`
``all_gather`` all of K/V; dK/dV reduce-scattered           :mod:`.all_gather`
``a2a``        q/k/v and the output, by all-to-all          :mod:`.ulysses`
``a2a+p2p``    refused (hierarchical CP is not built)
=============  ===========================================  ==============================

Inputs are Megatron's: each CP rank holds chunks r and 2·CP-1-r of every sequence
(``get_batch_on_this_cp_rank``), sbhd ``[s/CP, b, n, hn]``, or packed thd ``[t/CP, n, hn]``
where every packed sequence is cut into its own 2·CP chunks (:mod:`.thd`,
``get_thd_batch_on_this_cp_rank``). The CP group comes from ``pg_collection.cp``, falling back
to ``parallel_state``.
"""

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
    """This layer's comm type: the one Megatron passed, else ``config.cp_comm_type`` (a string
    or a per-layer list, indexed by the 1-based ``layer_number``), else ``"p2p"``."""
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

    Keyword arguments: ``heads`` (np), ``scale``, ``causal``, ``kernel``, ``keep_prob``,
    ``thd_ends`` (packed: the local padded cumulative ends without the leading 0, host ints;
    None for sbhd), ``window`` (``(left, right)``, -1 = unbounded; None = no window) and
    ``memo`` (the layer's ``SeqLengthsMemo``, owner of the packed index tensors). A case that
    :mod:`.rules` refuses raises ``ContextParallelUnsupported`` naming it and the fix.
    """
    return _ALGORITHMS[comm_type].attention(query, key, value, group, **kwargs)
