"""Mamba2's state-space scan (SSD) in mamba_ssm's calling convention, as chunked matmuls.

Per head, with ``dt' = clamp(softplus?(dt + dt_bias), dt_limit)``::

    state_t = exp(dt'_t A) state_{t-1} + dt'_t x_t B_t^T     [p, n]
    y_t     = (state_t C_t + D x_t) * silu(z_t)               [p]

x ``[b, t, h, p]``, dt ``[b, t, h]``, A ``[h]``, B / C ``[b, t, g, n]`` (head i reads group
``i // (h / g)``). A token whose ``seq_idx`` differs from the one before starts from a zero
state (``initial_states`` reach sequence 0 only). Computed in fp32 by chunks: within a chunk a
masked matmul, across chunks the chunk states; every exponent is a sum of ``dt' A <= 0`` (a
reset is -inf), never a difference, so strong decay stays exact and the result does not depend
on ``chunk_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_npu.ops import registry
from mcore_npu.ops.mamba.checks import validate_scan

OP = "mamba_chunk_scan_combined"


def mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    *,
    kernel: str = "auto",
):
    """``y [b, t, h, p]`` (x's dtype), or ``(y, final_states [b, h, p, n] fp32)``; ``kernel``:
    ``auto`` (an Ascend build of mamba_ssm where one imports on NPU tensors, else the
    reference), ``mamba_ssm`` or ``reference``."""
    args = (x, dt, A, B, C, chunk_size)
    options = dict(
        D=D,
        z=z,
        dt_bias=dt_bias,
        initial_states=initial_states,
        seq_idx=seq_idx,
        dt_softplus=dt_softplus,
        dt_limit=tuple(dt_limit),
        return_final_states=return_final_states,
    )
    validate_scan(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_limit)
    choice = registry.resolve(OP, kernel, x.device).kernel
    if choice != registry.REFERENCE:
        return registry.ascend(OP, choice)(*args, **options)
    return ssd_reference(*args, **options)


def ssd_reference(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
):
    """The pure-PyTorch scan (arguments as :func:`mamba_chunk_scan_combined`, checked there)."""
    step = _step_sizes(dt, dt_bias, dt_softplus, dt_limit)
    y, final = _chunked(x, step, A, B, C, chunk_size, initial_states, seq_idx)
    if D is not None:
        y = y + (D.float() if D.dim() == 2 else D.float()[:, None]) * x.float()
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, final) if return_final_states else y


def _step_sizes(dt, dt_bias, softplus: bool, dt_limit) -> torch.Tensor:
    """dt' ``[b, t, h]`` fp32: bias, then softplus, then the clamp (as mamba_ssm's kernel)."""
    step = dt.float() if dt_bias is None else dt.float() + dt_bias.float()
    if softplus:
        step = F.softplus(step)
    return step.clamp(min=float(dt_limit[0]), max=float(dt_limit[1]))


def _chunked(x, step, A, B, C, chunk, initial_states, seq_idx):
    """The scan without D and z: ``(y [b, t, h, p] fp32, final [b, h, p, n] fp32)``."""
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    pad = -t % chunk
    log_decay = step * A.float()  # [b, t, h], <= 0
    if seq_idx is not None:
        log_decay = log_decay.masked_fill(_resets(seq_idx)[..., None], float("-inf"))
    c = (t + pad) // chunk

    def chunks(v, *tail):  # [b, t, ...] -> [b, c, l, ...], zero padded at the end
        v = F.pad(v, (0, 0) * (v.dim() - 2) + (0, pad)) if pad else v
        return v.reshape(b, c, chunk, *tail)

    inputs = chunks(x.float() * step[..., None], g, h // g, p)  # dt' x  [b, c, l, g, r, p]
    decay = chunks(log_decay, g, h // g)  # [b, c, l, g, r]
    keys, queries = chunks(B.float(), g, n), chunks(C.float(), g, n)  # [b, c, l, g, n]
    within = decay.cumsum(2)  # decay from the chunk start through token i
    y = _diagonal(queries, keys, decay, inputs)
    states = _chunk_states(keys, decay, inputs)  # [b, c, g, r, p, n]
    start = None if initial_states is None else initial_states.float().reshape(b, g, h // g, p, n)
    entering, final = _pass_states(states, within[:, :, -1], start)
    y = y + torch.einsum("bcign,bcgrpn,bcigr->bcigrp", queries, entering, within.exp())
    return y.reshape(b, c * chunk, h, p)[:, :t], final.reshape(b, h, p, n)


def _resets(seq_idx) -> torch.Tensor:
    """``[b, t]`` True where a token starts from a zero state: a new sequence, or sequence 0's
    start when the row does not begin with sequence 0."""
    first = seq_idx[:, :1] != 0
    return torch.cat([first, seq_idx[:, 1:] != seq_idx[:, :-1]], dim=1)


def _segment_sums(decay: torch.Tensor, dim: int) -> torch.Tensor:
    """``out[..., i, j] = sum(decay[j+1 .. i])`` along ``dim`` (moved last), -inf where j > i:
    summed from the terms themselves (no difference of two cumulative sums)."""
    v = decay.movedim(dim, -1)
    length = v.shape[-1]
    lower = torch.ones(length, length, dtype=torch.bool, device=v.device).tril(-1)
    terms = v[..., :, None].expand(*v.shape, length).masked_fill(~lower, 0.0)  # [.., k, j]
    sums = terms.cumsum(-2)
    return sums.masked_fill(~torch.ones_like(lower).tril(), float("-inf"))


def _diagonal(queries, keys, decay, inputs) -> torch.Tensor:
    """Within each chunk: ``y_i = sum_{j<=i} (C_i . B_j) exp(sum decay(j, i]) (dt' x)_j``."""
    return _Diagonal.apply(queries, keys, decay, inputs)


BLOCK_BYTES = 4 * 2**20
"""Largest ``[chunks, g, r, l, l]`` fp32 tensor the within-chunk part holds at once."""


class _Diagonal(torch.autograd.Function):
    """The within-chunk part, a few chunks at a time; the backward recomputes the decay weights
    and saves only the inputs: queries / keys ``[b, c, l, g, n]``, decay ``[b, c, l, g, r]``,
    inputs ``[b, c, l, g, r, p]`` -> ``[b, c, l, g, r, p]``."""

    @staticmethod
    def forward(ctx, queries, keys, decay, inputs):
        ctx.save_for_backward(queries, keys, decay, inputs)
        out = torch.empty_like(inputs)
        for part in _blocks(decay):
            out[:, part] = _diagonal_block(
                queries[:, part], keys[:, part], decay[:, part], inputs[:, part]
            )[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        queries, keys, decay, inputs = ctx.saved_tensors
        grads = [torch.empty_like(t) for t in (queries, keys, decay, inputs)]
        for part in _blocks(decay):
            pieces = _diagonal_grad(
                queries[:, part], keys[:, part], decay[:, part], inputs[:, part], grad[:, part]
            )
            for into, piece in zip(grads, pieces, strict=True):
                into[:, part] = piece
        return tuple(grads)


def _blocks(decay):
    b, c, length, g, r = decay.shape
    step = max(1, BLOCK_BYTES // (4 * b * g * r * length * length))
    return [slice(i, min(i + step, c)) for i in range(0, c, step)]


def _diagonal_block(queries, keys, decay, inputs):
    scores = torch.einsum("bcign,bcjgn->bcgij", queries, keys)  # [b, c, g, l, l]
    weights = _segment_sums(decay, 2).exp_()  # [b, c, g, r, l, l], 0 above the diagonal
    mixed = weights * scores[:, :, :, None]
    return torch.einsum("bcgrij,bcjgrp->bcigrp", mixed, inputs), scores, weights, mixed


def _diagonal_grad(queries, keys, decay, inputs, grad):
    """Gradients of :func:`_diagonal_block` for queries, keys, decay and inputs."""
    _, scores, weights, mixed = _diagonal_block(queries, keys, decay, inputs)
    d_mixed = torch.einsum("bcigrp,bcjgrp->bcgrij", grad, inputs)
    d_inputs = torch.einsum("bcgrij,bcigrp->bcjgrp", mixed, grad)
    del mixed
    d_scores = (d_mixed * weights).sum(3)  # [b, c, g, l, l]
    d_queries = torch.einsum("bcgij,bcjgn->bcign", d_scores, keys)
    d_keys = torch.einsum("bcgij,bcign->bcjgn", d_scores, queries)
    d_sums = d_mixed.mul_(weights).mul_(scores[:, :, :, None])  # d/d sum decay(j, i]
    # d decay_k = sum over i >= k > j of d_sums[i, j]
    below = d_sums.flip(-2).cumsum(-2).flip(-2).cumsum(-1)
    d_decay = F.pad(torch.diagonal(below, offset=-1, dim1=-2, dim2=-1), (1, 0))
    return d_queries, d_keys, d_decay.permute(0, 1, 4, 2, 3), d_inputs


def _chunk_states(keys, decay, inputs) -> torch.Tensor:
    """Each chunk's own end state ``sum_j exp(sum decay(j, end]) (dt' x)_j B_j^T``."""
    after = decay.flip(2).cumsum(2).flip(2)  # sum decay[j .. end]
    after = torch.cat([after[:, :, 1:], torch.zeros_like(after[:, :, :1])], dim=2)  # (j, end]
    return torch.einsum("bcjgn,bcjgr,bcjgrp->bcgrpn", keys, after.exp(), inputs)


def _pass_states(states, totals, start):
    """The state entering each chunk ``[b, c, g, r, p, n]`` and the final one ``[b, g, r, p, n]``
    from each chunk's own state and total decay ``[b, c, g, r]`` (``start``: before chunk 0)."""
    if start is None:
        start = torch.zeros_like(states[:, 0])
    stacked = torch.cat([start[:, None], states], dim=1)  # [b, c + 1, ...]
    carried = F.pad(totals, (0, 0, 0, 0, 1, 0))  # chunk i's total moves it into i + 1
    weights = _segment_sums(carried, 1).exp()  # [b, g, r, c + 1, c + 1]
    passed = torch.einsum("bgrij,bjgrpn->bigrpn", weights, stacked)
    return passed[:, :-1], passed[:, -1]
