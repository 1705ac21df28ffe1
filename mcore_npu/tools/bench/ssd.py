"""``mcore-npu bench ssd``: Mamba2's chunked scan against transformers' pure-torch one.

CPU, float32, b = 1, T = 4096 (quick: 512), 8 heads of 64, 2 groups, dstate 128, chunk 128,
D per head, softplus with a bias (Nemotron-H's call, no z). The plugin's reference (its own
backward for the within-chunk part) against transformers' ``mamba2_chunk_scan`` (the pure-torch
fallback Nemotron-H's mixer calls without mamba_ssm, 5.25+; autograd), as a
:class:`~mcore_npu.tools.bench.versus.Contest` (``make bench-ssd`` runs it in the Nemotron-H
environment).
"""

from __future__ import annotations

import torch

from mcore_npu.ops.mamba import ssd_reference
from mcore_npu.tools.bench import versus

HEADS, HEAD_DIM, GROUPS, STATE, CHUNK = 8, 64, 2, 128, 128
SEED = 0


def _inputs(tokens: int):
    """x ``[1, T, 8, 64]``, dt ``[1, T, 8]``, A, B / C ``[1, T, 2, 128]``, D, dt_bias and the
    upstream gradient of y."""
    gen = torch.Generator().manual_seed(SEED + tokens)
    x, dy = (torch.randn(1, tokens, HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    dt = torch.randn(1, tokens, HEADS, generator=gen) - 2.0
    B, C = (torch.randn(1, tokens, GROUPS, STATE, generator=gen) for _ in range(2))
    A = -torch.rand(HEADS, generator=gen) * 4
    D, dt_bias = torch.randn(HEADS, generator=gen), torch.randn(HEADS, generator=gen) * 0.5
    return [x, dt, A, B, C, D, dt_bias], dy


def _ours(leaves):
    x, dt, A, B, C, D, dt_bias = leaves
    return ssd_reference(x, dt, A, B, C, CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True)


def _theirs(scan, leaves):
    x, dt, A, B, C, D, dt_bias = leaves
    return scan(x, dt, A, B, C, CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True)


CONTEST = versus.Contest(
    name="ssd",
    title="Mamba2 scan (SSD)",
    setup=(
        f"CPU fp32, b=1, T={{tokens}}, {HEADS} heads x {HEAD_DIM}, {GROUPS} groups, "
        f"dstate {STATE}, chunk {CHUNK}, D per head, softplus(dt + dt_bias)"
    ),
    inputs=_inputs,
    ours=_ours,
    theirs=_theirs,
    theirs_at="transformers.models.nemotron_h.modeling_nemotron_h:mamba2_chunk_scan",
    where="transformers >= 5.25: make bench-ssd",
)


def measure(quick: bool = False) -> dict:
    return versus.measure(CONTEST, quick)


table, plot = versus.table, versus.plot
