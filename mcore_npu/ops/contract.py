"""Constants and the normalised problem description of ``npu_fusion_attention``.

Everything here restates ``specs/npu_fusion_attention.md``; nothing here computes attention.

Shape legend used across ``mcore_npu.ops``::

    B   batch            Sq / Skv  query / key sequence lengths (TND: Tq / Tkv, total tokens)
    Nq  query heads      Nkv       key/value heads (Nq % Nkv == 0)
    D   q/k head dim     Dv        value head dim (Dv <= D)
    G   Nq / Nkv         query head i reads kv head i // G (GQA)
"""

from __future__ import annotations

from dataclasses import dataclass

INT32_MAX = 2147483647
"""Default of ``pre_tockens`` / ``next_tockens``: an unbounded band."""

LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")

COMPRESSED_MASK_SHAPE = (2048, 2048)
"""Modes 2, 3, 4, 7, 8 take this bool mask (strict upper triangle True); its content is fixed."""

PREFIX_COMPRESSED_MASK_SHAPE = (3072, 2048)
"""Mode 6 takes this bool mask: the 2048x2048 block stacked on a [1024, 2048] half mask."""

SPARSE_MODES_DENSE_LAYOUTS = frozenset({0, 1, 2, 3, 4, 5, 6})
SPARSE_MODES_TND = frozenset({0, 1, 2, 3, 4, 6, 7, 8})
MODES_WITH_COMPRESSED_MASK = frozenset({2, 3, 4, 7, 8})
MODES_WITH_BAND = frozenset({0, 4})
"""Modes whose ``pre_tockens`` / ``next_tockens`` bound the kept band (7/8: one segment's)."""

SPARSE_MODE_NAMES = {
    0: "defaultMask (dense mask, band from pre/next, top-left origin)",
    1: "allMask (dense mask as given)",
    2: "leftUpCausal (keep j <= i)",
    3: "rightDownCausal (keep j <= i + Skv - Sq)",
    4: "band, bottom-right origin (keep -pre <= j - i - (Skv - Sq) <= next)",
    5: "prefix (dense mask; keep j <= i + d or j < prefix[b])",
    6: "prefix, compressed [3072, 2048] mask",
    7: "varlen split-q, right-down causal (TND)",
    8: "varlen split-q, left-up causal (TND)",
}

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
"""q/k/v dtypes of the real kernel. The reference also takes float64 (for gradcheck and oracles)."""

MASK_DTYPES = ("bool", "uint8")

MAX_HEADS = 256
MAX_HEAD_DIM = 768
MAX_SEQ = 1024 * 1024
MAX_TND_SEGMENTS = 2048
MAX_PREFIX_BATCH = 32
ALIBI_COMPRESSED_ROWS = 1024


@dataclass(frozen=True)
class AttentionProblem:
    """The validated geometry of one call (host metadata). TND: ``batch`` = segments,
    ``seq_q``/``seq_kv`` = token totals, ``segments_*`` = ``[0] + actual_seq_*len`` (segment s spans
    ``segments_q[s]:segments_q[s + 1]``)."""

    layout: str
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_kv: int
    head_dim: int
    head_dim_v: int
    segments_q: tuple[int, ...] | None = None
    segments_kv: tuple[int, ...] | None = None

    def segment_lengths(self) -> list[tuple[int, int]]:
        """TND only: ``[(Sq_s, Skv_s), ...]`` per segment."""
        assert self.segments_q is not None and self.segments_kv is not None
        q, kv = self.segments_q, self.segments_kv
        return [(q[s + 1] - q[s], kv[s + 1] - kv[s]) for s in range(len(q) - 1)]

    def dropout_mask_numel(self) -> int:
        """Output 6 of the operator: ``B*N*Sq*Skv``; TND ``N * sum(Sq_s * Skv_s)``."""
        if self.layout == "TND":
            return self.heads_q * sum(sq * skv for sq, skv in self.segment_lengths())
        return self.batch * self.heads_q * self.seq_q * self.seq_kv
