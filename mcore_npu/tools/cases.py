"""The attention case table (``specs/attention_cases.yaml``): loading, expansion and inputs.

Used by the tests (reference vs an independent float64 oracle) and by ``mcore-npu verify``
(torch_npu vs the reference on NPU hardware). A case fixes a layout, a sparse mode with its mask,
a head grouping, a length relation and a dtype; ``make_inputs`` turns it into seeded tensors and
the operator's keyword arguments. Inputs of one case are the same across dtypes (drawn in float64,
then cast), so dtype errors can be compared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

from mcore_npu.masks import compressed_causal_mask, compressed_prefix_mask
from mcore_npu.ops.contract import INT32_MAX

DEFAULT_TABLE = Path(str(resources.files("mcore_npu").joinpath("specs/attention_cases.yaml")))
"""``specs/attention_cases.yaml``; ``mcore_npu/specs`` links to the top-level ``specs/`` and is
installed with the package, so ``mcore-npu verify`` finds the table after ``pip install``."""


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def bound(self, reference_magnitude: float) -> float:
        """The largest accepted ``max|got - want|`` for a reference of this magnitude."""
        return self.atol + self.rtol * reference_magnitude


@dataclass(frozen=True)
class ModeSpec:
    """One entry of the table's ``modes``."""

    name: str
    sparse_mode: int
    mask: str
    mask_shape: str = "SS"
    pre_tockens: int = INT32_MAX
    next_tockens: int = INT32_MAX
    prefix: str | None = None
    layouts: tuple[str, ...] | None = None


@dataclass(frozen=True)
class AttentionCase:
    """One expanded case. ``lengths`` is ``(Sq, Skv)`` or, for TND, per-segment pairs."""

    layout: str
    mode: ModeSpec
    heads_name: str
    heads: tuple[int, int]
    lengths_name: str
    lengths: tuple
    dtype: str
    batch: int
    head_dim: int
    scale: float
    seed: int
    forward: Tolerance
    grad: Tolerance
    head_dim_v: int | None = None  # None = head_dim; smaller for MLA's value (Dv < D)

    @property
    def value_dim(self) -> int:
        """Dv: the value's head dim."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def id(self) -> str:
        name = f"{self.layout}/{self.mode.name}/{self.heads_name}/{self.lengths_name}/{self.dtype}"
        return name if self.head_dim_v is None else f"{name}/Dv{self.head_dim_v}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class CaseInputs:
    """Tensors and keyword arguments of one case, plus the dense mask the oracle needs.

    ``dense_mask`` is the operator-polarity (True = masked) dense mask passed for mask kinds
    ``band``/``random``/``prefix_dense``, else None.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    head_num: int
    input_layout: str
    op_kwargs: dict[str, Any] = field(default_factory=dict)
    dense_mask: torch.Tensor | None = None

    def call_args(self) -> tuple:
        return (self.query, self.key, self.value, self.head_num, self.input_layout)


def load_cases(path: str | Path | None = None) -> list[AttentionCase]:
    """Expand the table into cases (its ``exclusions`` removed), in a stable order: the main
    grid, then the ``value_head_dim`` section (Dv < D, Multi-Latent Attention's value)."""
    path = Path(path) if path is not None else DEFAULT_TABLE
    if not path.is_file():
        raise FileNotFoundError(
            f"case table {path} not found; pass --cases /path/to/specs/attention_cases.yaml"
        )
    table = yaml.safe_load(path.read_text())
    modes = {m["name"]: ModeSpec(**_mode_fields(m)) for m in table["modes"]}
    cases = _expand(table, list(modes.values()), table["geometry"]["heads"],
                    table["geometry"]["lengths"], table["dtypes"], None)  # fmt: skip
    extra = table.get("value_head_dim")
    if extra:
        geometry = table["geometry"]
        cases += _expand(
            table, [modes[name] for name in extra["modes"]],
            {name: geometry["heads"][name] for name in extra["heads"]},
            {name: geometry["lengths"][name] for name in extra["lengths"]}, extra["dtypes"],
            int(extra["head_dim_v"]),
        )  # fmt: skip
    return cases


def _expand(table, modes, heads, lengths, dtypes, head_dim_v) -> list[AttentionCase]:
    geometry = table["geometry"]
    excluded = {(e["mode"], e["lengths"]) for e in table.get("exclusions", [])}
    cases = []
    for layout, mode, (heads_name, pair), (lengths_name, sizes), dtype in itertools.product(
        table["layouts"], modes, heads.items(), lengths.items(), dtypes
    ):
        if mode.layouts is not None and layout not in mode.layouts:
            continue
        if (mode.name, lengths_name) in excluded:
            continue
        shape = sizes["packed"] if layout == "TND" else sizes["dense"]
        tolerance = table["tolerances"][dtype]
        cases.append(
            AttentionCase(
                layout=layout, mode=mode, heads_name=heads_name, heads=tuple(pair),
                lengths_name=lengths_name, lengths=_freeze(shape), dtype=dtype,
                batch=geometry["batch"], head_dim=geometry["head_dim"],
                scale=float(geometry["scale"]), seed=int(table["seed"]),
                forward=Tolerance(**tolerance["forward"]), grad=Tolerance(**tolerance["grad"]),
                head_dim_v=head_dim_v,
            )
        )  # fmt: skip
    return cases


def _mode_fields(entry: dict) -> dict:
    fields = dict(entry)
    if "layouts" in fields:
        fields["layouts"] = tuple(fields["layouts"])
    return fields


def _freeze(value):
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


def make_inputs(
    case: AttentionCase,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    requires_grad: bool = True,
) -> CaseInputs:
    """Seeded inputs for ``case`` (values independent of dtype and device)."""
    dtype = dtype or case.torch_dtype
    gen = torch.Generator().manual_seed(_case_seed(case))
    q_shape, k_shape, v_shape = _shapes(case)
    q, k, v = (
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)  # cast on CPU
        for shape in (q_shape, k_shape, v_shape)
    )
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    kwargs, dense = _mask_kwargs(case, gen, torch.device(device))
    kwargs.update(scale=case.scale)
    if case.layout == "TND":
        kwargs.update(actual_seq_qlen=_ends(s for s, _ in case.lengths),
                      actual_seq_kvlen=_ends(s for _, s in case.lengths))  # fmt: skip
    return CaseInputs(q, k, v, case.heads[0], case.layout, kwargs, dense)


def _case_seed(case: AttentionCase) -> int:
    key = f"{case.seed}/{case.layout}/{case.mode.name}/{case.heads_name}/{case.lengths_name}"
    if case.head_dim_v is not None:
        key += f"/Dv{case.head_dim_v}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:6], "little")


def _ends(lengths) -> list[int]:
    total, ends = 0, []
    for n in lengths:
        total += n
        ends.append(total)
    return ends


def _shapes(case: AttentionCase) -> tuple[tuple[int, ...], ...]:
    """``(query, key, value)`` shapes (the value with Dv features per head)."""
    (nq, nkv), d, dv, b = case.heads, case.head_dim, case.value_dim, case.batch
    if case.layout == "TND":
        tq, tkv = sum(s for s, _ in case.lengths), sum(s for _, s in case.lengths)
        return (tq, nq, d), (tkv, nkv, d), (tkv, nkv, dv)
    sq, skv = case.lengths
    return {
        "BSH": ((b, sq, nq * d), (b, skv, nkv * d), (b, skv, nkv * dv)),
        "SBH": ((sq, b, nq * d), (skv, b, nkv * d), (skv, b, nkv * dv)),
        "BSND": ((b, sq, nq, d), (b, skv, nkv, d), (b, skv, nkv, dv)),
        "BNSD": ((b, nq, sq, d), (b, nkv, skv, d), (b, nkv, skv, dv)),
    }[case.layout]


def _mask_kwargs(case, gen, device) -> tuple[dict[str, Any], torch.Tensor | None]:
    mode = case.mode
    kwargs: dict[str, Any] = {"sparse_mode": mode.sparse_mode}
    if mode.pre_tockens != INT32_MAX or mode.next_tockens != INT32_MAX:
        kwargs.update(pre_tockens=mode.pre_tockens, next_tockens=mode.next_tockens)
    if mode.prefix == "auto":
        pairs = case.lengths if case.layout == "TND" else [case.lengths] * case.batch
        kwargs["prefix"] = [max(0, skv - sq) + (skv - max(0, skv - sq)) // 2 for sq, skv in pairs]
    dense = None
    if mode.mask in ("compressed", "prefix_compressed"):
        builder = compressed_causal_mask if mode.mask == "compressed" else compressed_prefix_mask
        kwargs["atten_mask"] = builder(device)
    elif mode.mask in ("band", "random", "prefix_dense"):
        dense = _dense_mask(case, gen).to(device)
        kwargs["atten_mask"] = dense
    return kwargs, dense


def _dense_mask(case: AttentionCase, gen: torch.Generator) -> torch.Tensor:
    """The case's dense mask, True = masked out, in the shape its ``mask_shape`` names."""
    mode = case.mode
    if case.layout == "TND":
        sq = max(s for s, _ in case.lengths)
        skv = max(s for _, s in case.lengths)
        shape = (sq, skv)
    else:
        sq, skv = case.lengths
        b, n = case.batch, case.heads[0]
        shape = {"SS": (sq, skv), "11SS": (1, 1, sq, skv), "B1SS": (b, 1, sq, skv),
                 "BNSS": (b, n, sq, skv)}[mode.mask_shape]  # fmt: skip
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(skv)
    if mode.mask == "band":
        keep = (j - i >= -mode.pre_tockens) & (j - i <= mode.next_tockens)
        return (~keep).expand(shape).clone()
    if mode.mask == "prefix_dense":
        prefix = torch.tensor([max(0, skv - sq) + (skv - max(0, skv - sq)) // 2] * case.batch)
        keep = (j <= i + skv - sq) | (j < prefix.view(-1, 1, 1, 1))
        return (~keep).expand(case.batch, 1, sq, skv).clone()
    masked = torch.rand(shape, generator=gen) < 0.4
    masked[..., 0] = False  # every row (of every TND segment's crop) keeps key 0: no invalid row
    return masked


def shrink(case: AttentionCase, **geometry) -> AttentionCase:
    """The same case with other sizes (e.g. tiny ones for gradcheck)."""
    return dataclasses.replace(case, **geometry)
