"""What the NPU spec's context parallelism takes: one function that answers, with reasons.

The YAML validator, the recipe translator, the attention module and each algorithm ask
:func:`not_supported_reasons` (or :func:`check`, which raises). A reason names its argument in
Megatron's words; a caller whose users write other keys renders it in theirs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

BUILT = ("p2p", "all_gather", "a2a")
KNOWN = (*BUILT, "a2a+p2p")


class ContextParallelUnsupported(ValueError, NotImplementedError):
    """A refused context-parallel call: both a ValueError and a NotImplementedError."""


@dataclass(frozen=True)
class Reason:
    """Why a call is refused: ``fact`` is the argument and ``value`` its value; ``problem`` and
    ``fix`` may name arguments as ``{name}`` fields, which :meth:`render` fills in a caller's words.
    """

    fact: str
    value: object
    problem: str
    fix: str

    def render(self, names: Mapping[str, str] | None = None) -> tuple[str, str, str]:
        """``(key, problem, fix)``, every argument named as ``names`` says (default: as is)."""
        words = _Words(names or {})
        return words[self.fact], self.problem.format_map(words), self.fix.format_map(words)

    def __str__(self) -> str:
        key, problem, fix = self.render()
        return f"{key}={self.value!r}: {problem}; fix: {fix}"


class _Words(dict):
    def __missing__(self, name: str) -> str:
        return name


def not_supported_reasons(
    comm_type: str,
    cp_size: int,
    *,
    causal: bool = True,
    dropout: float = 0.0,
    window: tuple[int, int] | None = None,
    packed: bool = False,
    heads: int | None = None,
    groups: int | None = None,
    tp: int = 1,
) -> list[Reason]:
    """Why ``comm_type`` over ``cp_size`` ranks cannot run a call (empty: it can).

    ``window`` is Megatron's ``window_size`` (``(left, right)``, -1 unbounded), ``dropout`` the
    probability (0 in eval), ``packed`` a thd batch; ``heads`` / ``groups``: query heads and KV
    groups over ``tp`` tensor-parallel ranks (None: not known yet)."""
    if comm_type not in KNOWN:
        fix = f"use one of {', '.join(BUILT)}"
        return [Reason("cp_comm_type", comm_type, "unknown value", fix)]
    if comm_type == "a2a+p2p":
        problem = "hierarchical context parallelism is not built for NPUFusionAttention"
        fix = "use {cp_comm_type}='a2a' within a node-sized CP group or 'p2p' across"
        return [Reason("cp_comm_type", comm_type, problem, fix)]
    window = None if window is None else tuple(window)
    if comm_type == "p2p":
        return _ring(causal, dropout, window, packed)
    if comm_type == "all_gather":
        return _all_gather(causal, window, packed)
    return _ulysses(cp_size, heads, groups, tp)


def check(comm_type: str, cp_size: int, *, where: str = "", **facts) -> None:
    """:func:`not_supported_reasons`, raised as one :class:`ContextParallelUnsupported` (``where``:
    the message's prefix, e.g. ``"layer 3"``)."""
    reasons = not_supported_reasons(comm_type, cp_size, **facts)
    if reasons:
        prefix = f"{where}: " if where else ""
        raise ContextParallelUnsupported(prefix + "; ".join(map(str, reasons)))


_RING_DROPOUT = "the p2p ring's gradient operator cannot replay a dropout mask"
_RING_BAND = (
    "a p2p ring block of a sliding window over packed (thd) sequences is a band shifted by "
    "the chunk length, which differs between the sequences: one operator call cannot hold it"
)
_PACKED_WINDOW = "unpacked (sbhd) batches, or {context_parallel_size}=1"  # the last resorts


def _ring(causal, dropout, window, packed) -> list[Reason]:
    reasons = []
    if not causal:
        fix = "use {cp_comm_type}='all_gather' or 'a2a' for a non-causal layer"
        reasons.append(Reason("cp_comm_type", "p2p", "the ring runs causal attention only", fix))
    if dropout > 0:
        fix = "set it to 0, or {cp_comm_type}='all_gather' or 'a2a'"
        reasons.append(Reason("attention_dropout", dropout, _RING_DROPOUT, fix))
    if packed and window is not None and window[0] != -1:
        fix = (
            "use {cp_comm_type}='a2a' or 'all_gather' for windowed packed batches, "
            + _PACKED_WINDOW
        )
        reasons.append(Reason("window_size", window, _RING_BAND, fix))
    return reasons


def _all_gather(causal, window, packed) -> list[Reason]:
    if not packed or window is None:
        return []
    if window[1] != 0:
        problem = "cp_comm_type='all_gather' takes causal windows (left, 0) on packed batches"
        return [Reason("window_size", window, problem, "use " + _PACKED_WINDOW)]
    if not causal:
        problem = "a window on a non-causal layer over packed batches is not split over CP ranks"
        return [Reason("window_size", window, problem, "use a causal layer, " + _PACKED_WINDOW)]
    return []


def _ulysses(cp_size, heads, groups, tp) -> list[Reason]:
    reasons = []
    for fact, count, what in (
        ("num_attention_heads", heads, "query heads"),
        ("num_query_groups", groups, "KV groups"),
    ):
        if count is not None and (count // tp) % cp_size:
            problem = (
                f"{count // tp} {what} per tensor-parallel rank do not divide by "
                f"context_parallel_size={cp_size}; cp_comm_type='a2a' gives each CP rank 1/CP "
                "of the heads"
            )
            fix = "use a CP size that divides both, or {cp_comm_type}='p2p' or 'all_gather'"
            reasons.append(Reason(fact, count, problem, fix))
    return reasons
