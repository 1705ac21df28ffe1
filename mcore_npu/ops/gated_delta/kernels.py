"""The Ascend kernels of the gated delta rule, as the registry hands them over (at call time):

- ``fla``: fla's ``chunk_gated_delta_rule`` (triton-ascend on an NPU), trainable, called with
  fla's own convention.
- ``torch_npu``: ``npu_chunk_gated_delta_rule(query, key, value, *, beta, initial_state,
  actual_seq_lengths, scale, g)``, **forward only**, TND: q/k ``[T, Nk, Dk]``, v ``[T, Nv, Dv]``,
  beta/g ``[T, Nv]``, states ``[B, Nv, Dv, Dk]`` (transposed against fla's); bf16, Dk = Dv = 128,
  Nv <= 64.
- ``fla_npu``: the Ascend C building blocks (``mcore_npu.ops.gated_delta.fla_npu_chain``).
"""

from __future__ import annotations

import torch

from mcore_npu._optional import import_optional
from mcore_npu.ops import registry
from mcore_npu.ops.gated_delta.norms import l2norm

NPU_FORWARD_DTYPES = (torch.bfloat16,)
NPU_FORWARD_HEAD_DIM = 128
NPU_FORWARD_MAX_HEADS = 64
OP = "chunk_gated_delta_rule"

__all__ = ["import_optional", "run_fla", "run_torch_npu", "torch_npu_unsupported"]


def torch_npu_unsupported(q, v) -> str | None:
    """Why the forward-only torch_npu kernel cannot take this call, or None when it can."""
    if v.dtype not in NPU_FORWARD_DTYPES or q.dtype not in NPU_FORWARD_DTYPES:
        return f"it takes bfloat16 only (q {q.dtype}, v {v.dtype})"
    if q.shape[-1] != NPU_FORWARD_HEAD_DIM or v.shape[-1] != NPU_FORWARD_HEAD_DIM:
        return f"it takes K = V = 128 only (K {q.shape[-1]}, V {v.shape[-1]})"
    if v.shape[2] > NPU_FORWARD_MAX_HEADS:
        return f"it takes at most 64 value heads ({v.shape[2]})"
    return None


def run_fla(
    q,
    k,
    v,
    g,
    beta,
    *,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    use_qk_l2norm_in_kernel,
):
    """fla's kernel with fla's own keywords (the operator's convention is fla's)."""
    kwargs = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state)
    kwargs.update(cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return registry.ascend(OP, "fla")(q, k, v, g, beta, **kwargs)


def run_torch_npu(
    q, k, v, g, beta, *, scale, initial_state, output_final_state, bounds, use_qk_l2norm_in_kernel
):
    """torch_npu's forward-only kernel: fla layout in, TND for the operator, fla layout out;
    ``bounds``: ``[0, T]`` (then every batch row is one sequence) or the packed segments."""
    op = registry.ascend(OP, "torch_npu")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    b, t, hv, dv = v.shape
    packed = len(bounds) > 2 or b == 1
    lengths = [e - s for s, e in zip(bounds, bounds[1:])] if packed else [t] * b
    if initial_state is None:
        state = v.new_zeros(len(lengths), hv, dv, q.shape[-1])
    else:
        state = initial_state.transpose(-1, -2).to(v.dtype).contiguous()
    q_t, k_t, v_t = (x.reshape(b * t, *x.shape[2:]) for x in (q, k, v))
    beta_t, g_t = beta.reshape(b * t, hv).to(v.dtype), g.reshape(b * t, hv).float()
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device=v.device)
    kwargs = dict(beta=beta_t, initial_state=state, actual_seq_lengths=lengths_t)
    out, final = op(q_t, k_t, v_t, **kwargs, scale=float(scale), g=g_t)
    final = final.transpose(-1, -2).float() if output_final_state else None
    return out.reshape(b, t, hv, dv), final
