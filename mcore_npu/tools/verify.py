"""``mcore-npu verify``: a case table, forward and backward, against a trusted answer.

The table (``--cases``, default ``specs/attention_cases.yaml``) is read by
``cases.load_table``; each case's ``kind`` picks its check in :data:`CHECKS`. Two modes, by the
device: **hardware** (an NPU is usable) runs the kernel on the NPU against the reference in
float32 on the CPU, on the same rounded inputs; **oracle** (no NPU, or ``--device cpu``) runs
the reference in the case's dtype against a float64 oracle (attention's is in this module: a
masked softmax written from the operator contract, no code shared with ``mcore_npu.ops``).
Fully masked ("invalid") query rows, decided by the oracle's keep mask, are left out of every
comparison. A quantity passes when ``max|got - want| <= atol + rtol * max|want|``. docs/verify.md
has the details.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_npu.allocator import device as accelerators
from mcore_npu.ops import fusion_attention, fusion_attention_grad, fusion_attention_with_stats
from mcore_npu.tools import dsa_cases, fused_cases, gdn_cases, mamba_cases
from mcore_npu.tools.cases import (
    DEFAULT_TABLE,
    AttentionCase,
    Case,
    CaseInputs,
    load_table,
    make_inputs,
)
from mcore_npu.tools.comparison import CaseResult, Comparison, compare

__all__ = [
    "CaseResult",
    "Comparison",
    "OracleResult",
    "Target",
    "add_arguments",
    "check_kernel_case",
    "check_reference_case",
    "choose_target",
    "compare",
    "oracle",
    "run",
    "run_cases",
]

GRAD_SEED = 7  # of the upstream gradient (d loss / d out) of every attention case
QUANTITIES = AttentionCase.quantities

ORACLE_CHECK = "checked the reference against the float64 oracle"
NO_NPU_NOTE = f"no NPU: hardware comparison skipped; {ORACLE_CHECK}"


class UsageError(Exception):
    """A command-line request that cannot be served (exit status 2)."""


@dataclass(frozen=True)
class OracleResult:
    """``out``: float64, the query's layout with D replaced by Dv (differentiable);
    ``valid_out`` (``out``'s shape) and ``valid_q`` (the query's): False on rows that keep no key.
    """

    out: torch.Tensor
    valid_out: torch.Tensor
    valid_q: torch.Tensor


def oracle(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    **op_kwargs,
) -> OracleResult:
    """``npu_fusion_attention`` by definition, in float64, on the CPU: each sparse mode's keep
    mask from its formula in ``specs/npu_fusion_attention.md`` (section 6), an explicit masked
    softmax (0 on rows that keep no key), query head i reading kv head ``i // (Nq / Nkv)``; no
    dropout or ``pse``. Pass float64 leaves for float64 gradients; of ``op_kwargs`` only the
    mask-shaping ones, ``scale`` and ``actual_seq_qlen``/``actual_seq_kvlen`` count."""
    q, k, v = (t.cpu().double() for t in (query, key, value))
    rule = _KeepRule.from_kwargs(op_kwargs)
    layout = input_layout.upper()
    if layout == "TND":
        return _oracle_packed(q, k, v, rule, op_kwargs)
    heads_kv = _kv_heads(q, k, head_num, layout)
    q4, k4, v4 = (_to_bnsd(t, layout, n) for t, n in ((q, head_num), (k, heads_kv), (v, heads_kv)))
    keep = rule.keep(q4.shape[-2], k4.shape[-2], rule.mask, rule.prefix, rule.mode)
    out, valid = _masked_attention(q4, k4, v4, keep, rule.scale)  # [B, N, Sq, Dv], [B, N, Sq]
    return OracleResult(
        out=_from_bnsd(out, layout),
        valid_out=_from_bnsd(valid[..., None].expand(out.shape), layout),
        valid_q=_from_bnsd(valid[..., None].expand(q4.shape), layout),
    )


@dataclass(frozen=True)
class _KeepRule:
    """The mask-shaping operator arguments, with the keep condition of each mode.
    ``keep`` returns True = kept; ``mask`` is the operator's ``atten_mask`` (True = masked out).
    """

    mode: int = 0
    mask: torch.Tensor | None = None
    pre: int = 2147483647
    nxt: int = 2147483647
    prefix: tuple[int, ...] | None = None
    scale: float = 1.0

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> _KeepRule:
        mask = kwargs.get("atten_mask")
        prefix = kwargs.get("prefix")
        return cls(
            mode=int(kwargs.get("sparse_mode", 0)),
            mask=None if mask is None else mask.detach().cpu().bool(),
            pre=int(kwargs.get("pre_tockens", 2147483647)),
            nxt=int(kwargs.get("next_tockens", 2147483647)),
            prefix=None if prefix is None else tuple(int(p) for p in prefix),
            scale=float(kwargs.get("scale", 1.0)),
        )

    def keep(self, seq_q, seq_kv, mask, prefix, mode) -> torch.Tensor:
        """Keep mask of one block, broadcastable to ``[B, N, Sq, Skv]`` (True = kept);
        ``mask``: the block's dense mask (modes 0/1), ``prefix``: per-batch lengths (5/6)."""
        i = torch.arange(seq_q).view(-1, 1)  # [Sq, 1]
        j = torch.arange(seq_kv).view(1, -1)  # [1, Skv]
        d = seq_kv - seq_q
        if mode in (0, 1):
            if mask is None:  # no atten_mask: full attention, pre/next ignored
                return torch.ones(seq_q, seq_kv, dtype=torch.bool)
            keep = ~mask
            if mode == 0:  # the band, origin top-left
                keep = keep & (j - i >= -self.pre) & (j - i <= self.nxt)
            return keep
        if mode == 2:
            return j <= i
        if mode == 3:
            return j <= i + d
        if mode == 4:  # the band, origin bottom-right
            return (j - i - d >= -self.pre) & (j - i - d <= self.nxt)
        if mode in (5, 6):
            limits = torch.tensor(prefix).view(-1, 1, 1, 1)  # [B, 1, 1, 1]
            return (j <= i + d) | (j < limits)  # [B, 1, Sq, Skv]
        raise ValueError(f"sparse_mode {mode}: not a mode of a single block")


def _masked_attention(q, k, v, keep, scale):
    """Masked softmax attention on ``[B, N, S, D]`` (K/V with their own head count):
    ``(out [B, Nq, Sq, Dv], valid [B, Nq, Sq])``; rows with no kept key are 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, Nq, Skv, D]
    scores = (q @ k.transpose(-1, -2)) * scale  # [B, Nq, Sq, Skv]
    keep = keep.expand(scores.shape)
    valid = keep.any(-1)  # [B, Nq, Sq]
    if scores.shape[-1] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), valid
    scores = scores.masked_fill(~keep, -math.inf)
    shift = torch.where(valid, scores.detach().amax(-1), 0.0)  # any finite shift is exact
    weights = torch.exp(scores - shift[..., None])  # exp(-inf) = 0 where masked
    total = torch.where(valid, weights.sum(-1), 1.0)
    return (weights / total[..., None]) @ v, valid


def _oracle_packed(q, k, v, rule: _KeepRule, kwargs: dict) -> OracleResult:
    """TND: one independent attention per (q segment, kv segment)."""
    ends_q, ends_kv = list(kwargs["actual_seq_qlen"]), list(kwargs["actual_seq_kvlen"])
    spans = list(zip([0, *ends_q[:-1]], ends_q, [0, *ends_kv[:-1]], ends_kv))
    band = _band_segment(rule.mode, [(b - a, d - c) for a, b, c, d in spans])
    outs, valids = [], []
    for s, (q0, q1, k0, k1) in enumerate(spans):
        seq_q, seq_kv = q1 - q0, k1 - k0
        if seq_q == 0:
            continue
        mode = rule.mode
        if mode in (7, 8):
            mode = 4 if s == band else (3 if mode == 7 else 2)
        mask = rule.mask[:seq_q, :seq_kv] if rule.mask is not None else None
        prefix = None if rule.prefix is None else (rule.prefix[s],)
        keep = rule.keep(seq_q, seq_kv, mask, prefix, mode)
        # [T, N, D] slice -> [1, N, S_s, D]
        blocks = (
            t[a:b].transpose(0, 1).unsqueeze(0)
            for t, a, b in ((q, q0, q1), (k, k0, k1), (v, k0, k1))
        )
        out, valid = _masked_attention(*blocks, keep, rule.scale)
        outs.append(out[0].transpose(0, 1))  # [S_s, N, Dv]
        valids.append(valid[0].transpose(0, 1))  # [S_s, N]
    heads, dim_v = q.shape[1], v.shape[-1]
    out = torch.cat(outs) if outs else q.new_zeros(0, heads, dim_v)
    valid = torch.cat(valids) if valids else torch.zeros(0, heads, dtype=torch.bool)
    return OracleResult(
        out=out,
        valid_out=valid[..., None].expand(out.shape),
        valid_q=valid[..., None].expand(q.shape),
    )


def _band_segment(mode: int, lengths: list[tuple[int, int]]) -> int | None:
    """Modes 7/8: the segment that takes the band (7: last with Sq_s > 0; 8: first, Skv_s > 0)."""
    if mode == 7:
        return max((s for s, (sq, _) in enumerate(lengths) if sq > 0), default=None)
    if mode == 8:
        return min((s for s, (_, skv) in enumerate(lengths) if skv > 0), default=None)
    return None


def _kv_heads(q: torch.Tensor, k: torch.Tensor, head_num: int, layout: str) -> int:
    if layout in ("BSH", "SBH"):
        return k.shape[-1] // (q.shape[-1] // head_num)
    return k.shape[2] if layout == "BSND" else k.shape[1]


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BSH":  # [B, S, N*D] -> [B, N, S, D]
        return t.unflatten(-1, (heads, -1)).transpose(1, 2)
    if layout == "SBH":  # [S, B, N*D] -> [B, N, S, D]
        return t.unflatten(-1, (heads, -1)).permute(1, 2, 0, 3)
    if layout == "BSND":  # [B, S, N, D] -> [B, N, S, D]
        return t.transpose(1, 2)
    return t


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BSH":  # [B, N, S, D] -> [B, S, N*D]
        return t.transpose(1, 2).flatten(2)
    if layout == "SBH":  # [B, N, S, D] -> [S, B, N*D]
        return t.permute(2, 0, 1, 3).flatten(2)
    if layout == "BSND":  # [B, N, S, D] -> [B, S, N, D]
        return t.transpose(1, 2)
    return t


def _upstream_grad(shape, dtype: torch.dtype, valid_out: torch.Tensor) -> torch.Tensor:
    """The seeded ``d loss / d out`` in ``dtype``, zero on invalid rows (CPU)."""
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(GRAD_SEED))
    return grad.to(dtype).masked_fill(~valid_out, 0)


def _cpu_kwargs(op_kwargs: dict) -> dict:
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in op_kwargs.items()}


def _grad_comparisons(got_leaves, want_leaves, valid_q, tolerance) -> list[Comparison]:
    rows = (valid_q, None, None)  # dk/dv: every key row (invalid query rows send no gradient)
    return [
        compare(name, got.grad, want.grad, valid, tolerance)
        for name, got, want, valid in zip(("dq", "dk", "dv"), got_leaves, want_leaves, rows)
    ]


def check_reference_case(case: AttentionCase, device: torch.device | str = "cpu") -> CaseResult:
    """Oracle mode: the reference in the case's dtype against the float64 oracle; also requires
    output 0 and dq 0 on invalid rows, and finite gradients everywhere."""
    inputs = make_inputs(case, device=device)
    got_leaves = (inputs.query, inputs.key, inputs.value)
    want_leaves = [t.detach().cpu().double().requires_grad_() for t in got_leaves]
    want = oracle(
        *want_leaves, inputs.head_num, inputs.input_layout, **_cpu_kwargs(inputs.op_kwargs)
    )
    grad = _upstream_grad(want.out.shape, case.torch_dtype, want.valid_out)
    got = fusion_attention(*inputs.call_args(), kernel="reference", **inputs.op_kwargs)
    dy = grad.to(got.device)
    got.backward(dy)
    want.out.backward(grad.double())
    comparisons = [compare("forward", got, want.out, want.valid_out, case.forward)]
    comparisons += _grad_comparisons(got_leaves, want_leaves, want.valid_q, case.grad)
    grads = [t.grad for t in want_leaves]
    comparisons += _op_grad_comparisons(inputs, dy, "reference", grads, want.valid_q, case.grad)
    problems = []
    if bool((got.detach().cpu()[~want.valid_out] != 0).any()):
        problems.append("the output is not 0 on invalid (fully masked) rows")
    if bool((inputs.query.grad.cpu()[~want.valid_q] != 0).any()):
        problems.append("dq is not 0 on invalid (fully masked) rows")
    for name, leaf in zip(("dq", "dk", "dv"), got_leaves):
        if not bool(torch.isfinite(leaf.grad).all()):
            problems.append(f"{name} has NaN or inf entries")
    return CaseResult(case.id, tuple(comparisons), tuple(problems))


def check_kernel_case(case: AttentionCase, device: torch.device | str) -> CaseResult:
    """Hardware mode: ``torch_npu`` on ``device`` against the float32 reference on the CPU, both
    on the inputs rounded to the case's dtype on the CPU (the reference upcasts them)."""
    rounded = make_inputs(case, requires_grad=False)  # the case's dtype, CPU
    device_leaves = [t.to(device, copy=True).requires_grad_() for t in rounded.call_args()[:3]]
    device_kwargs = {
        k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in rounded.op_kwargs.items()
    }
    ref_leaves = [t.to(torch.float32, copy=True).requires_grad_() for t in rounded.call_args()[:3]]
    heads, layout = rounded.head_num, rounded.input_layout
    with torch.no_grad():
        truth = oracle(*(t.double() for t in ref_leaves), heads, layout, **rounded.op_kwargs)
    grad = _upstream_grad(truth.out.shape, case.torch_dtype, truth.valid_out)
    got = fusion_attention(*device_leaves, heads, layout, kernel="torch_npu", **device_kwargs)
    got.backward(grad.to(got.device))
    want = fusion_attention(*ref_leaves, heads, layout, kernel="reference", **rounded.op_kwargs)
    want.backward(grad.float())
    comparisons = [compare("forward", got, want, truth.valid_out, case.forward)]
    comparisons += _grad_comparisons(device_leaves, ref_leaves, truth.valid_q, case.grad)
    on_device = CaseInputs(*device_leaves, heads, layout, device_kwargs)
    grads, dy = [t.grad for t in ref_leaves], grad.to(device)
    comparisons += _op_grad_comparisons(on_device, dy, "torch_npu", grads, truth.valid_q, case.grad)
    return CaseResult(case.id, tuple(comparisons))


CHECKS = {  # a case's kind -> (its oracle-mode check, its hardware-mode check)
    "attention": (check_reference_case, check_kernel_case),
    "fused_ops": (fused_cases.check_reference_fused_case, fused_cases.check_kernel_fused_case),
    "gated_delta": (gdn_cases.check_reference_gdn_case, gdn_cases.check_kernel_gdn_case),
    "mamba": (mamba_cases.check_reference_mamba_case, mamba_cases.check_kernel_mamba_case),
    "dsa": (dsa_cases.check_reference_dsa_case, dsa_cases.check_kernel_dsa_case),
}


def _op_grad_comparisons(inputs, dy, kernel, want_grads, valid_q, tolerance):
    """``npu_fusion_attention_grad`` (as ring attention calls it per block: given the forward's
    statistics and output) against ``want_grads``, as ``op-dq``/``op-dk``/``op-dv``. None for
    dropout cases: no kernel can replay the mask."""
    kwargs = dict(inputs.op_kwargs)
    if float(kwargs.get("keep_prob", 1.0)) != 1.0:
        return []
    q, k, v = (t.detach() for t in inputs.call_args()[:3])
    heads, layout = inputs.head_num, inputs.input_layout
    with torch.no_grad():
        out, smax, ssum = fusion_attention_with_stats(
            q, k, v, heads, layout, kernel=kernel, **kwargs
        )
    kwargs["scale_value"] = kwargs.pop("scale", 1.0)
    stats = {"softmax_max": smax, "softmax_sum": ssum, "attention_in": out}
    dy = dy.to(out.dtype)
    grads = fusion_attention_grad(q, k, v, dy, heads, layout, kernel=kernel, **stats, **kwargs)
    rows = (valid_q, None, None)
    return [
        compare(f"op-{name}", got, want, valid, tolerance)
        for name, got, want, valid in zip(("dq", "dk", "dv"), grads[:3], want_grads, rows)
    ]


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """One CPU thread for torch while the (tiny) cases run, then the previous count again."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def run_cases(
    cases: Iterable[Case],
    check: Callable[[Case], CaseResult],
    on_result: Callable[[CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Run ``check`` on every case; an exception fails that case only (its message is kept)."""
    results = []
    for case in cases:
        try:
            result = check(case)
        except Exception as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            result = CaseResult(case.id, problems=(f"{type(exc).__name__}: {first_line}",))
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


@dataclass(frozen=True)
class Target:
    """Where the cases run and against what."""

    device: torch.device
    hardware: bool
    note: str = ""

    @property
    def mode(self) -> str:
        return "hardware" if self.hardware else "oracle"

    def check(self, case: Case) -> CaseResult:
        reference, kernel = CHECKS[case.kind]
        return (kernel if self.hardware else reference)(case, self.device)


def choose_target(requested: str | None) -> Target:
    """``--device``: None picks the NPU when one is usable, else the CPU (oracle mode); an
    explicit ``npu`` device that is not usable is an error, not a silent fallback."""
    if requested is None:
        if accelerators.is_npu_available():
            return Target(accelerators.current_device(), hardware=True)
        return Target(torch.device("cpu"), hardware=False, note=NO_NPU_NOTE)
    if requested.split(":", 1)[0].strip().lower() == "npu":
        if not accelerators.is_npu_available():
            reason = accelerators.npu_import_error() or "torch_npu is not installed or sees no NPU"
            raise UsageError(
                f"--device {requested}: no usable NPU ({reason}). Run `mcore-npu doctor` for the "
                "cause, or omit --device to check the reference against the float64 oracle"
            )
        return Target(torch.device(requested), hardware=True)
    try:
        chosen = torch.device(requested)
    except (RuntimeError, ValueError) as exc:
        message = f"--device {requested!r}: not a device ({exc}); e.g. npu:0 or cpu"
        raise UsageError(message) from exc
    note = f"--device {requested}: hardware comparison skipped; {ORACLE_CHECK}"
    return Target(chosen, hardware=False, note=note)


def select_cases(path: str | Path | None, substring: str | None) -> list[Case]:
    """The table's cases whose id contains ``substring`` (all of them without one)."""
    cases = load_table(path)
    if substring:
        cases = [case for case in cases if substring in case.id]
        if not cases:
            raise UsageError(
                f"--filter {substring!r}: no case id contains it; ids look like "
                f"'BSH/causal_bottom_right/GQA/q_longer/bfloat16'"
            )
    return cases


@dataclass
class _TextReport:
    """Prints the pass/fail table row by row (to the current ``sys.stdout``)."""

    id_width: int
    quantities: tuple[str, ...] = QUANTITIES

    def header(self) -> None:
        columns = "".join(f"{name:>10}" for name in self.quantities)
        print(f"{'':6}{'case':<{self.id_width}}{columns}", flush=True)

    def row(self, result: CaseResult) -> None:
        cells = "".join(_cell(result, name) for name in self.quantities)
        status = "PASS" if result.passed else "FAIL"
        print(f"{status:6}{result.case_id:<{self.id_width}}{cells}".rstrip(), flush=True)
        for line in _failure_details(result):
            print(f"{'':6}  {line}", flush=True)


def _cell(result: CaseResult, name: str) -> str:
    error = result.error(name)
    if error is None:
        return f"{'-':>10}"
    failed = any(c.name == name and not c.passed for c in result.comparisons)
    return f"{error:>9.1e}{'!' if failed else ' '}"


def _failure_details(result: CaseResult) -> list[str]:
    lines = [
        f"{c.name}: max error {c.max_error:.3e} > bound {c.bound:.3e} ({c.compared} values)"
        for c in result.comparisons
        if not c.passed
    ]
    return lines + list(result.problems)


def summary_line(results: Sequence[CaseResult]) -> str:
    """``"1450 cases: 1450 passed, 0 failed"``."""
    passed = sum(result.passed for result in results)
    return f"{len(results)} cases: {passed} passed, {len(results) - passed} failed"


def _number(value: float) -> float | str:
    """JSON has no NaN/inf: keep finite numbers, spell the others."""
    return value if math.isfinite(value) else str(value)


def _result_json(result: CaseResult) -> dict:
    entry: dict = {"id": result.case_id, "passed": result.passed}
    for c in result.comparisons:
        error, bound = _number(c.max_error), _number(c.bound)
        entry[c.name] = {
            "max_error": error,
            "bound": bound,
            "compared": c.compared,
            "passed": c.passed,
        }
    entry["problems"] = list(result.problems)
    return entry


def _report_json(target: Target, args, results, seconds: float) -> dict:
    passed = sum(result.passed for result in results)
    counts = {"cases": len(results), "passed": passed, "failed": len(results) - passed}
    return {
        "mode": target.mode,
        "device": str(target.device),
        "note": target.note,
        "cases_file": str(args.cases),
        "filter": args.filter,
        "results": [_result_json(result) for result in results],
        "summary": {**counts, "seconds": round(seconds, 2), "line": summary_line(results)},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases",
        default=str(DEFAULT_TABLE),
        help="the case table (default: specs/attention_cases.yaml of this checkout)",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="npu:N compares torch_npu against the reference; cpu checks the reference against "
        "the float64 oracle (default: the NPU when one is usable, else cpu)",
    )
    parser.add_argument("--filter", default=None, help="only cases whose id contains SUBSTRING")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")


def run(args: argparse.Namespace) -> int:
    """Run the table; exit 0 when every case passes, 1 on any failure, 2 on a bad request."""
    try:
        cases = select_cases(args.cases, args.filter)
        target = choose_target(args.device)
    except (UsageError, FileNotFoundError) as err:
        print(f"mcore-npu verify: error: {err}", file=sys.stderr, flush=True)
        return 2
    start = time.perf_counter()
    with single_threaded():
        if args.json:
            results = run_cases(cases, target.check)
            report = _report_json(target, args, results, time.perf_counter() - start)
            print(json.dumps(report, indent=1))
        else:
            results = _run_text(cases, target, args)
            print(f"elapsed: {time.perf_counter() - start:.1f} s on {target.device}")
            print(summary_line(results), flush=True)
    failed = sum(not result.passed for result in results)
    if failed:
        print(f"mcore-npu verify: {summary_line(results)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


def _run_text(cases: list[Case], target: Target, args) -> list[CaseResult]:
    if target.note:
        print(target.note)
    selection = f", filter {args.filter!r}" if args.filter else ""
    print(
        f"cases: {args.cases} ({len(cases)} cases{selection}); mode {target.mode}, "
        f"device {target.device}"
    )
    id_width = max(len(case.id) for case in cases) + 2
    report = _TextReport(id_width=id_width, quantities=cases[0].quantities)
    report.header()
    results = run_cases(cases, target.check, on_result=report.row)
    failures = [result for result in results if not result.passed]
    if failures:
        print(f"\nfailed ({len(failures)}):")
        for result in failures:
            print(f"  {result.case_id}: " + "; ".join(_failure_details(result)))
    return results
