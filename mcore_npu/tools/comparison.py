"""One case's outcome in ``mcore-npu verify``: a :class:`Comparison` per quantity (the largest
error where it counts, against the case's bound) and the :class:`CaseResult` of the case;
:func:`normal` draws the operator tables' seeded inputs, :func:`compare_outputs` compares an
operator's output, final state and input gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_npu.tools.cases import Tolerance


@dataclass(frozen=True)
class Comparison:
    """One quantity of one case: the largest error over the compared elements and its bound."""

    name: str
    max_error: float
    bound: float
    compared: int

    @property
    def passed(self) -> bool:
        """NaN or inf errors fail (``nan <= bound`` is False)."""
        return self.max_error <= self.bound


@dataclass(frozen=True)
class CaseResult:
    """The outcome of one case: its comparisons and any other problem found."""

    case_id: str
    comparisons: tuple[Comparison, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.problems and all(c.passed for c in self.comparisons)

    def error(self, name: str) -> float | None:
        """The max error of quantity ``name``, or None if it was not compared."""
        return next((c.max_error for c in self.comparisons if c.name == name), None)


def compare(
    name: str,
    got: torch.Tensor,
    want: torch.Tensor,
    valid: torch.Tensor | None,
    tolerance: Tolerance,
) -> Comparison:
    """Compare ``got`` (any dtype and device) with ``want`` where ``valid`` (bool, same shape;
    None = everywhere) is True; invalid (fully masked) rows are False there. The bound is
    ``atol + rtol * max|want[valid]|``; ``max_error`` is NaN if a compared ``got`` is NaN."""
    if got.shape != want.shape:
        raise ValueError(
            f"{name}: shape {list(got.shape)} of the result differs from the expected "
            f"{list(want.shape)}"
        )
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    if valid is not None:
        valid = valid.cpu()
        got, want = got[valid], want[valid]
    if want.numel() == 0:
        return Comparison(name, 0.0, tolerance.bound(0.0), 0)
    error = (got - want).abs().max().item()  # torch's max propagates NaN
    bound = tolerance.bound(want.abs().max().item())
    return Comparison(name, error, bound, want.numel())


def normal(shape, seed: int) -> torch.Tensor:
    """Seeded standard-normal float64 draws (the operator tables' inputs)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def compare_outputs(case, got, got_leaves, want, want_leaves) -> CaseResult:
    """``got`` / ``want`` are ``(out, final state or None)``: the output, the state and every
    input gradient (upstream gradients: seeded normal noise) as forward, state, grad0, ..."""
    (out, state), (want_out, want_state) = got, want
    comparisons = [compare("forward", out, want_out, None, case.forward)]
    if want_state is not None:
        comparisons.append(compare("state", state, want_state, None, case.forward))
    if case.param("no_grad"):
        return CaseResult(case.id, tuple(comparisons))
    up_out = normal(want_out.shape, case.seed + 99)
    up_state = None if want_state is None else normal(want_state.shape, case.seed + 98)

    def grads(result, leaves):
        o, st = result
        loss = (o * up_out.to(o)).sum()
        if st is not None:
            loss = loss + (st * up_state.to(st)).sum()
        return torch.autograd.grad(loss, leaves, allow_unused=True)

    for i, (g, w) in enumerate(zip(grads(got, got_leaves), grads(want, want_leaves))):
        g = torch.zeros_like(got_leaves[i]) if g is None else g
        comparisons.append(compare(f"grad{i}", g, w, None, case.grad))
    return CaseResult(case.id, tuple(comparisons))
