"""The trainable Ascend C chain of flash-linear-attention-npu (``fla_npu``), with our autograd.

fla_npu ships building blocks (looked up at call time in ``fla_npu.ops.ascendc``), not a
trainable operator. Their layout is head-first: q, k, v ``[B, HV, T, D]`` (q and k repeated to
the value heads here), g (cumulated) and beta ``[B, HV, T]``; packed segments as a list
``cu_seqlens`` plus the flat ``(segment, chunk)`` list ``chunk_indices``. The chain:

forward: ``npu_chunk_local_cumsum`` -> ``npu_chunk_scaled_dot_kkt`` -> ``npu_solve_tri`` ->
``npu_recompute_w_u_fwd`` -> ``npu_chunk_gated_delta_rule_fwd_h`` -> ``npu_chunk_fwd_o``;
backward: ``npu_recompute_w_u_fwd`` -> ``npu_chunk_gated_delta_rule_fwd_h`` ->
``npu_chunk_bwd_dv_local`` -> ``npu_chunk_gated_delta_rule_bwd_dhu`` -> ``npu_chunk_bwd_dqkwg``
-> ``npu_prepare_wy_repr_bwd_da`` -> ``npu_prepare_wy_repr_bwd_full`` -> reverse
``npu_chunk_local_cumsum`` of dg.

The blocks take fp16/bf16 q/k/v, K = 128, V in {128, 256}, and no gradient for the initial
state or through the final state; :func:`unsupported` says why a call is outside that.
"""

from __future__ import annotations

import torch

from mcore_npu.ops import registry
from mcore_npu.ops.gated_delta.norms import l2norm

CHUNK = 64
DTYPES = (torch.float16, torch.bfloat16)
KEY_DIMS = (128,)
VALUE_DIMS = (128, 256)
OPS = ("npu_chunk_local_cumsum", "npu_chunk_scaled_dot_kkt", "npu_solve_tri")
OPS += ("npu_recompute_w_u_fwd", "npu_chunk_gated_delta_rule_fwd_h", "npu_chunk_fwd_o")
OPS += ("npu_chunk_bwd_dv_local", "npu_chunk_gated_delta_rule_bwd_dhu", "npu_chunk_bwd_dqkwg")
OPS += ("npu_prepare_wy_repr_bwd_da", "npu_prepare_wy_repr_bwd_full")


def blocks():
    """``fla_npu.ops.ascendc`` (through the registry) when it imports and has every building
    block, else None."""
    try:
        module = registry.ascend("chunk_gated_delta_rule", "fla_npu")
    except ImportError:
        return None
    if not all(callable(getattr(module, name, None)) for name in OPS):
        return None
    return module


def available() -> bool:
    return blocks() is not None


def unsupported(q, v, initial_state=None, output_final_state=False) -> str | None:
    """Why the chain cannot take this call (None when it can)."""
    if q.dtype not in DTYPES or v.dtype != q.dtype:
        return f"it takes float16/bfloat16 q, k, v only (q {q.dtype}, v {v.dtype})"
    if q.shape[-1] not in KEY_DIMS or v.shape[-1] not in VALUE_DIMS:
        return f"it takes K = 128 and V in 128/256 only (K {q.shape[-1]}, V {v.shape[-1]})"
    if initial_state is not None and initial_state.requires_grad:
        return "it has no initial-state gradient"
    if output_final_state:
        return "it has no gradient through the final state"
    return None


def chunk_indices(bounds: list[int]) -> list[int]:
    """The flat ``[segment, chunk, segment, chunk, ...]`` list of packed segments."""
    flat = []
    for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        for c in range(-(-(e - s) // CHUNK)):
            flat += [n, c]
    return flat


class _Chain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, packed):
        ops, cu, idx = blocks(), *packed
        heads = q.shape[2]
        qh, kh, vh = _head_first(q, v.shape[2]), _head_first(k, v.shape[2]), v.transpose(1, 2)
        gh, bh = g.transpose(1, 2).float().contiguous(), beta.transpose(1, 2).float().contiguous()
        packed_in = dict(cu_seqlens=cu, chunk_indices=idx)
        cumsum = dict(cu_seqlens=cu, chunk_indices_out=idx, head_first=True)
        gc = ops.npu_chunk_local_cumsum(gh, CHUNK, **cumsum)
        kkt = ops.npu_chunk_scaled_dot_kkt(kh, gc, bh, **packed_in, chunk_size=CHUNK)
        a = _solve(ops, kkt, q.dtype, cu, idx)
        h, v_new, _ = _states(ops, kh, vh, bh, a, gc, initial_state, cu, idx)
        o = ops.npu_chunk_fwd_o(qh, kh, v_new, h, scale, g=gc, **packed_in, chunk_size=CHUNK)
        ctx.save_for_backward(qh, kh, vh, gc, bh, a, initial_state)
        ctx.scale, ctx.packed, ctx.heads, ctx.dtypes = scale, packed, heads, (g.dtype, beta.dtype)
        ctx.set_materialize_grads(False)
        return o.transpose(1, 2)

    @staticmethod
    def backward(ctx, d_o):
        if d_o is None:
            return (None,) * 8
        ops, (cu, idx), scale = blocks(), ctx.packed, ctx.scale
        qh, kh, vh, gc, bh, a, initial_state = ctx.saved_tensors
        doh = d_o.transpose(1, 2).contiguous()
        h, v_new, w = _states(ops, kh, vh, bh, a, gc, initial_state, cu, idx, want_w=True)
        packed_in = dict(cu_seqlens=cu, chunk_indices=idx)
        dv = ops.npu_chunk_bwd_dv_local(qh, kh, doh, gc, scale, CHUNK, A=a, **packed_in)
        dh, _, dv = ops.npu_chunk_gated_delta_rule_bwd_dhu(
            qh, kh, w, doh, dv, scale, CHUNK, g=gc, **packed_in
        )
        dq, dk, dw, dg = ops.npu_chunk_bwd_dqkwg(
            qh, kh, v_new, gc, h, doh, dh, dv, CHUNK, **packed_in, scale=scale
        )
        da = ops.npu_prepare_wy_repr_bwd_da(
            kh, vh, bh, a, dw, dv, gc, chunk_size=CHUNK, **packed_in
        )
        dk_wy, dv, dbeta, dg_wy = ops.npu_prepare_wy_repr_bwd_full(
            kh, vh, bh, a, da, dw, dv, gc, CHUNK, **packed_in
        )
        reverse = dict(cu_seqlens=cu, chunk_indices_out=idx, reverse=True, head_first=True)
        dg = ops.npu_chunk_local_cumsum(dg + dg_wy, CHUNK, **reverse)
        dq, dk = _token_first(dq, ctx.heads), _token_first(dk + dk_wy, ctx.heads)
        g_dtype, beta_dtype = ctx.dtypes
        dg, dbeta = dg.transpose(1, 2).to(g_dtype), dbeta.transpose(1, 2).to(beta_dtype)
        return dq, dk, dv.transpose(1, 2), dg, dbeta, None, None, None


def _head_first(x, value_heads: int) -> torch.Tensor:
    """``[B, T, H, D]`` -> ``[B, HV, T, D]`` (q/k heads repeated to the value heads)."""
    groups = value_heads // x.shape[2]
    x = x.repeat_interleave(groups, dim=2) if groups > 1 else x
    return x.transpose(1, 2).contiguous()


def _token_first(dx, heads: int) -> torch.Tensor:
    """``[B, HV, T, D]`` -> ``[B, T, H, D]``, summing the value heads of each q/k head."""
    b, hv, t, d = dx.shape
    return dx.view(b, heads, hv // heads, t, d).sum(2).transpose(1, 2)


def _solve(ops, a, dtype, cu, idx):
    """``(I + A)^-1`` per chunk; fla_npu's solver reads ``[B, T, HV, C]`` (or TND packed)."""
    if cu is None:
        solved = ops.npu_solve_tri(a.to(dtype).transpose(1, 2).contiguous(), layout="bsnd")
        return solved.transpose(1, 2).contiguous()
    tnd = a.to(dtype).transpose(1, 2).squeeze(0).contiguous()
    solved = ops.npu_solve_tri(tnd, cu_seqlens=cu, chunk_indices=idx, layout="tnd")
    return solved.unsqueeze(0).transpose(1, 2).contiguous()


def _states(ops, kh, vh, bh, a, gc, initial_state, cu, idx, want_w=False):
    w, u = ops.npu_recompute_w_u_fwd(kh, vh, bh, a, CHUNK, g=gc, cu_seqlens=cu, chunk_indices=idx)
    states = dict(initial_state=initial_state, output_final_state=False, chunk_size=CHUNK)
    h, v_new, _ = ops.npu_chunk_gated_delta_rule_fwd_h(
        kh, w, u, gc, **states, cu_seqlens=cu, chunk_indices=idx
    )
    return h, v_new, (w if want_w else None)


def run(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale,
    initial_state,
    output_final_state,
    bounds,
    cu_seqlens,
    use_qk_l2norm_in_kernel,
):
    """The chain on checked inputs in fla's layout; returns ``(o [B, T, HV, V], None)``."""
    if blocks() is None:
        message = "kernel='fla_npu' needs flash-linear-attention-npu (fla_npu) with its "
        message += f"Ascend C operators {', '.join(OPS)}; "
        message += "fix: install it on the Ascend machine, or use kernel='auto'"
        raise ImportError(message)
    why = unsupported(q, v, initial_state, output_final_state)
    if why is not None:
        raise ValueError(
            f"chunk_gated_delta_rule: kernel: 'fla_npu' cannot take this call: "
            f"{why}\n  fix: use kernel='auto' (it picks a kernel that can)"
        )
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    packed = (None, None) if cu_seqlens is None else (list(bounds), chunk_indices(bounds))
    init = None if initial_state is None else initial_state.to(q.dtype).contiguous()
    o = _Chain.apply(q, k, v, g, beta, init, float(scale), packed)
    return o, None
