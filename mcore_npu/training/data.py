"""Byte-level text data for ``mcore-npu train``: deterministic, resumable, split by rank.

Tokens are UTF-8 bytes (0..255); 256 ends a document. Sample ``k`` is ``seq_length + 1`` tokens
at a seeded pseudo-random offset, whatever the parallel layout or a resume; global step ``s``
uses samples ``s * global_batch ..``, each data-parallel rank its contiguous share.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from mcore_npu.training.config import ConfigError

END_OF_DOCUMENT = 256


def load_corpus(path: str | None = None, seq_length: int | None = None) -> torch.Tensor:
    """The tokens of ``path`` (UTF-8 text) or of the embedded corpus: int64 ``[N]`` (``ConfigError``
    for an unusable ``data.path``, or one too short for a sample of ``seq_length + 1`` tokens)."""
    if path is None:
        text = (
            resources.files("mcore_npu.training")
            .joinpath("corpus/default.txt")
            .read_text(encoding="utf-8")
        )
    else:
        text = read_text_file(path)
    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    tokens = torch.cat([data, torch.tensor([END_OF_DOCUMENT])])
    if path is not None and seq_length is not None and tokens.numel() <= seq_length + 1:
        needs = f"(train.seq_length + 1 = {seq_length + 1})"
        problem = f"has {tokens.numel() - 1} bytes, fewer than one sample needs {needs}"
        fix = "use a longer text or a shorter train.seq_length"
        raise ConfigError("data.path", path, problem, fix)
    return tokens


def read_text_file(path: str) -> str:
    """The text of ``path``; only UTF-8 is accepted (``ConfigError`` naming ``data.path``)."""
    file = Path(path)
    fix = "pass a non-empty UTF-8 text file (convert others, e.g. iconv -t UTF-8), or null"
    if file.is_dir():
        raise ConfigError("data.path", path, "is a directory, not a text file", fix)
    try:
        raw = file.read_bytes()
    except OSError as err:
        raise ConfigError(
            "data.path", path, f"cannot be read ({err.strerror or err})", fix
        ) from None
    if not raw:
        raise ConfigError("data.path", path, "is empty", fix)
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise ConfigError("data.path", path, f"looks binary (a NUL byte at offset {nul})", fix)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        problem = f"is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start})"
        raise ConfigError("data.path", path, problem, fix) from None


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch, ``[b, s]`` each (packed: ``[1, b*s]``, with ``cu_seqlens`` int32 ``[b + 1]``
    with a leading 0 and ``seq_ends`` the same as host ints without it, so no layer syncs)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    seq_ends: tuple[int, ...] | None = None

    def to(self, device) -> MicroBatch:
        moved = {
            name: getattr(self, name).to(device)
            for name in ("tokens", "labels", "loss_mask", "position_ids")
        }
        cu = None if self.cu_seqlens is None else self.cu_seqlens.to(device)
        return MicroBatch(
            **moved, cu_seqlens=cu, max_seqlen=self.max_seqlen, seq_ends=self.seq_ends
        )


class ByteDataset:
    """Samples of ``seq_length + 1`` tokens from a token stream, in a seeded order."""

    def __init__(self, tokens: torch.Tensor, seq_length: int, seed: int) -> None:
        starts = tokens.numel() - seq_length - 1
        if starts <= 0:
            raise ValueError(
                f"data: the text has {tokens.numel()} tokens, too few for train.seq_length="
                f"{seq_length}; use a longer text (data.path) or a shorter sequence"
            )
        self.tokens = tokens
        self.seq_length = seq_length
        self.order = torch.randperm(starts, generator=torch.Generator().manual_seed(seed))

    def sample(self, index: int) -> torch.Tensor:
        """Sample ``index`` (any non-negative int; the order repeats every epoch): ``[S + 1]``."""
        start = int(self.order[index % self.order.numel()])
        return self.tokens[start : start + self.seq_length + 1]

    def micro_batches(
        self,
        step: int,
        *,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        packed: bool = False,
    ) -> Iterator[MicroBatch]:
        """This data-parallel rank's micro-batches of global step ``step`` (0-based)."""
        per_rank = global_batch // dp_size
        first = step * global_batch + dp_rank * per_rank
        for offset in range(0, per_rank, micro_batch):
            rows = torch.stack([self.sample(first + offset + i) for i in range(micro_batch)])
            yield _packed(rows) if packed else _dense(rows)


def _dense(rows: torch.Tensor) -> MicroBatch:
    batch, width = rows.shape
    seq = width - 1
    return MicroBatch(
        tokens=rows[:, :-1].contiguous(),
        labels=rows[:, 1:].contiguous(),
        loss_mask=torch.ones(batch, seq),
        position_ids=torch.arange(seq).expand(batch, seq).contiguous(),
    )


def _packed(rows: torch.Tensor) -> MicroBatch:
    """The rows as one packed sequence ``[1, b*s]``; each row is its own segment."""
    dense = _dense(rows)
    batch, seq = dense.tokens.shape
    return MicroBatch(
        tokens=dense.tokens.reshape(1, -1),
        labels=dense.labels.reshape(1, -1),
        loss_mask=dense.loss_mask.reshape(1, -1),
        position_ids=dense.position_ids.reshape(1, -1),
        cu_seqlens=torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32),
        max_seqlen=seq,
        seq_ends=tuple(range(seq, (batch + 1) * seq, seq)),
    )
