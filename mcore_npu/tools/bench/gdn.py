"""``mcore-npu bench gdn``: the chunked gated delta rule against transformers' own.

CPU, float32, b = 1, T = 4096 (quick: 512), 4 heads, K = V = 128, in-kernel l2norm, log-decay
uniform in [-1, 0], beta uniform in (0, 1). The plugin's reference (chunk 64, its own backward)
against ``transformers.models.qwen3_5.modeling_qwen3_5.torch_chunk_gated_delta_rule`` (chunk 64,
autograd), as a :class:`~mcore_npu.tools.bench.versus.Contest` (run it in the verl environment:
``.venv-verl/bin/mcore-npu bench gdn``).
"""

from __future__ import annotations

import torch

from mcore_npu.ops.gated_delta import chunk_gated_delta_rule
from mcore_npu.tools.bench import versus

HEADS = 4
HEAD_DIM = 128
SEED = 0


def _inputs(tokens: int):
    """q, k, v ``[1, T, 4, 128]``, g, beta ``[1, T, 4]`` and the upstream gradient of o."""
    gen = torch.Generator().manual_seed(SEED + tokens)
    q, k, v, do = (torch.randn(1, tokens, HEADS, HEAD_DIM, generator=gen) for _ in range(4))
    g = -torch.rand(1, tokens, HEADS, generator=gen)
    beta = torch.rand(1, tokens, HEADS, generator=gen)
    return [q, k, v, g, beta], do


def _ours(leaves):
    return chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True, kernel="reference")[0]


def _theirs(rule, leaves):
    return rule(*leaves, chunk_size=64, use_qk_l2norm_in_kernel=True)[0]


CONTEST = versus.Contest(
    name="gdn",
    title="Gated delta rule",
    setup=f"CPU fp32, b=1, T={{tokens}}, {HEADS} heads, K=V={HEAD_DIM}, in-kernel l2norm, chunk 64",
    inputs=_inputs,
    ours=_ours,
    theirs=_theirs,
    theirs_at="transformers.models.qwen3_5.modeling_qwen3_5:torch_chunk_gated_delta_rule",
    where="run it in .venv-verl",
)


def measure(quick: bool = False) -> dict:
    return versus.measure(CONTEST, quick)


table, plot = versus.table, versus.plot
