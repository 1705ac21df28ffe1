"""The case tables of ``mcore-npu verify`` (``specs/*_cases.yaml``): one loader, one case type.

:func:`load_table` reads a table, tells its kind from its ``kind`` key (none: ``attention``) and
expands it into :class:`Case` objects of that kind: :class:`AttentionCase` (layout x sparse mode
x head grouping x lengths x dtype), :class:`FusedCase` (``fused_ops``) and
:class:`GatedDeltaCase` (``gated_delta``) and :class:`MambaCase` (``mamba``), one per operator
entry and dtype. Inputs are drawn in float64 from the case's seed, then cast, so one case's
inputs agree across dtypes: :func:`make_inputs` for attention, ``make_call`` of
``fused_cases`` / ``gdn_cases`` / ``mamba_cases`` for the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml

from mcore_npu.masks import compressed_causal_mask, compressed_prefix_mask
from mcore_npu.ops.contract import INT32_MAX
from mcore_npu.tools import permute_cases


def _table(name: str) -> Path:
    # mcore_npu/specs links to the top-level specs/ and is installed with the package
    return Path(str(resources.files("mcore_npu").joinpath(f"specs/{name}")))


DEFAULT_TABLE = _table("attention_cases.yaml")
FUSED_TABLE = _table("fused_ops_cases.yaml")
GDN_TABLE = _table("gated_delta_cases.yaml")
MAMBA_TABLE = _table("mamba_cases.yaml")
DSA_TABLE = _table("dsa_cases.yaml")


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def bound(self, reference_magnitude: float) -> float:
        """The largest accepted ``max|got - want|`` for a reference of this magnitude."""
        return self.atol + self.rtol * reference_magnitude


class Case:
    """What every case has: ``id``, ``forward``/``grad`` tolerances, its table's ``kind`` and
    the ``quantities`` that ``verify`` reports for it (its columns)."""

    kind: ClassVar[str]
    quantities: ClassVar[tuple[str, ...]]
    id: str
    forward: Tolerance
    grad: Tolerance


@dataclass(frozen=True)
class ModeSpec:
    """One entry of the attention table's ``modes``."""

    name: str
    sparse_mode: int
    mask: str
    mask_shape: str = "SS"
    pre_tockens: int = INT32_MAX
    next_tockens: int = INT32_MAX
    prefix: str | None = None
    layouts: tuple[str, ...] | None = None


@dataclass(frozen=True)
class AttentionCase(Case):
    """One attention case. ``lengths`` is ``(Sq, Skv)`` or, for TND, per-segment pairs."""

    kind = "attention"
    quantities = ("forward", "dq", "dk", "dv")

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
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def id(self) -> str:
        name = f"{self.layout}/{self.mode.name}/{self.heads_name}/{self.lengths_name}/{self.dtype}"
        return name if self.head_dim_v is None else f"{name}/Dv{self.head_dim_v}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class OperatorCase(Case):
    """One entry of an operator table in one dtype; ``params`` are the entry's sorted items."""

    id: str
    operator: str
    params: tuple[tuple[str, Any], ...]
    dtype: torch.dtype
    forward: Tolerance
    grad: Tolerance
    seed: int

    def param(self, name: str, default=None):
        return dict(self.params).get(name, default)


class FusedCase(OperatorCase):
    kind = "fused_ops"
    operators = ("npu_rms_norm", "npu_swiglu", "npu_grouped_matmul", "npu_rotary_mul")
    operators += permute_cases.OPERATORS
    quantities = ("forward", "grad0", "grad1")  # grads of x, then of gamma or the weights


class GatedDeltaCase(OperatorCase):
    kind = "gated_delta"
    operators = ("chunk_gated_delta_rule", "causal_conv1d", "l2norm", "gated_rms_norm")
    # the output, the final state (the rule only), the inputs' gradients in call order
    quantities = ("forward", "state", "grad0", "grad1", "grad2", "grad3", "grad4", "grad5")


class MambaCase(OperatorCase):
    kind = "mamba"
    operators = ("mamba_chunk_scan_combined", "rms_norm_gated")
    # the output, the final state (the scan only), the inputs' gradients in call order
    quantities = ("forward", "state", *(f"grad{i}" for i in range(9)))


class DsaCase(OperatorCase):
    kind = "dsa"
    operators = ("lightning_indexer", "sparse_flash_attention")
    # the output (indexer: the selected keys' scores), the indexer's wrong selections, the
    # gradients of query, key, value, query_rope, key_rope
    quantities = ("forward", "indices", *(f"grad{i}" for i in range(5)))


KINDS = {cls.kind: cls for cls in (AttentionCase, FusedCase, GatedDeltaCase, MambaCase, DsaCase)}


def table_kind(path) -> str | None:
    """The ``kind`` of the table at ``path`` (``attention`` if it names none); None if
    ``path`` is not a readable YAML mapping."""
    try:
        table = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return table.get("kind", "attention") if isinstance(table, dict) else None


def load_table(path: str | Path | None = None) -> list[Case]:
    """Every case of the table at ``path`` (default: the attention table), in a stable order."""
    path = Path(path) if path is not None else DEFAULT_TABLE
    if not path.is_file():
        raise FileNotFoundError(
            f"case table {path} not found; pass --cases /path/to/specs/attention_cases.yaml"
        )
    table = yaml.safe_load(path.read_text(encoding="utf-8"))
    kind = table.get("kind", "attention") if isinstance(table, dict) else "attention"
    if kind == "attention":
        return _attention_cases(table)
    return _operator_cases(KINDS[kind], table)


def load_cases(path: str | Path | None = None) -> list[AttentionCase]:
    """The attention table's cases (its ``exclusions`` removed): the main grid, then the
    ``value_head_dim`` section (Dv < D, multi-latent attention's value)."""
    return load_table(path)


def _operator_cases(case_type: type[OperatorCase], table: dict) -> list[OperatorCase]:
    cases = []
    for operator in case_type.operators:
        for entry in table.get(operator, []):
            digest = int(hashlib.sha256(entry["name"].encode()).hexdigest()[:6], 16)
            seed = table["seed"] + digest
            params = tuple(sorted((k, _freeze(v)) for k, v in entry.items()))
            for dtype in table["dtypes"]:
                tol = table["tolerances"][dtype]
                forward, grad = Tolerance(**tol["forward"]), Tolerance(**tol["grad"])
                args = (operator, params, getattr(torch, dtype), forward, grad, seed)
                cases.append(case_type(f"{operator}/{entry['name']}/{dtype}", *args))
    return cases


def _attention_cases(table: dict) -> list[AttentionCase]:
    modes = {m["name"]: ModeSpec(**{k: _freeze(v) for k, v in m.items()}) for m in table["modes"]}
    geometry = table["geometry"]
    cases = _expand(table, modes.values(), geometry["heads"], geometry["lengths"], table["dtypes"])
    extra = table.get("value_head_dim")
    if extra:
        heads = {name: geometry["heads"][name] for name in extra["heads"]}
        lengths = {name: geometry["lengths"][name] for name in extra["lengths"]}
        extra_modes = [modes[name] for name in extra["modes"]]
        dv = int(extra["head_dim_v"])
        cases += _expand(table, extra_modes, heads, lengths, extra["dtypes"], dv)
    return cases


def _expand(table, modes, heads, lengths, dtypes, head_dim_v=None) -> list[AttentionCase]:
    geometry = table["geometry"]
    fixed = (geometry["batch"], geometry["head_dim"], float(geometry["scale"]), int(table["seed"]))
    excluded = {(e["mode"], e["lengths"]) for e in table.get("exclusions", [])}
    cases = []
    for layout, mode, (heads_name, pair), (lengths_name, sizes), dtype in itertools.product(
        table["layouts"], modes, heads.items(), lengths.items(), dtypes
    ):
        if mode.layouts is not None and layout not in mode.layouts:
            continue
        if (mode.name, lengths_name) in excluded:
            continue
        tol = table["tolerances"][dtype]
        tolerances = Tolerance(**tol["forward"]), Tolerance(**tol["grad"])
        sizes = _freeze(sizes["packed"] if layout == "TND" else sizes["dense"])
        names = (layout, mode, heads_name, tuple(pair), lengths_name, sizes, dtype)
        cases.append(AttentionCase(*names, *fixed, *tolerances, head_dim_v))  # in field order
    return cases


def _freeze(value):
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


@dataclass
class CaseInputs:
    """Tensors and keyword arguments of one attention case. ``dense_mask``: the dense mask
    (True = masked out) passed for mask kinds ``band``/``random``/``prefix_dense``, else None."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    head_num: int
    input_layout: str
    op_kwargs: dict[str, Any] = field(default_factory=dict)
    dense_mask: torch.Tensor | None = None

    def call_args(self) -> tuple:
        return (self.query, self.key, self.value, self.head_num, self.input_layout)


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
    q, k, v = (
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)  # cast on CPU
        for shape in _shapes(case)
    )
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    kwargs, dense = _mask_kwargs(case, gen, torch.device(device))
    kwargs.update(scale=case.scale)
    if case.layout == "TND":
        kwargs["actual_seq_qlen"] = list(itertools.accumulate(s for s, _ in case.lengths))
        kwargs["actual_seq_kvlen"] = list(itertools.accumulate(s for _, s in case.lengths))
    return CaseInputs(q, k, v, case.heads[0], case.layout, kwargs, dense)


def _case_seed(case: AttentionCase) -> int:
    key = f"{case.seed}/{case.layout}/{case.mode.name}/{case.heads_name}/{case.lengths_name}"
    if case.head_dim_v is not None:
        key += f"/Dv{case.head_dim_v}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:6], "little")


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
        shape = {
            "SS": (sq, skv),
            "11SS": (1, 1, sq, skv),
            "B1SS": (b, 1, sq, skv),
            "BNSS": (b, n, sq, skv),
        }[mode.mask_shape]
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
