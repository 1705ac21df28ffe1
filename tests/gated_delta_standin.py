"""Stand-ins for the Ascend gated-delta kernels (no NPU here), put into ``sys.modules``.

- ``torch_npu.npu_chunk_gated_delta_rule`` (forward only, TND, states ``[B, Nv, Dv, Dk]``):
  records the call and answers from its documented contract with the float64 oracle
  (``mcore_npu.tools.gdn_cases.recurrent_rule``), sequence by sequence.
- ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``: records the call, answers with the
  reference.
- ``fla_npu.ops.ascendc``: the eleven building blocks of the Ascend C chain. Each records its
  call (name, argument shapes, keywords). The forward blocks compute what fla_npu documents
  (chunk-local cumsum, the strictly lower ``beta k k^T exp(g_i - g_j)``, ``(I + A)^-1``,
  ``w``/``u``, the chunk states, the output), written here for one unpacked sequence per row,
  so a wrong layout or transpose in the caller changes the numbers. The backward blocks answer
  zeros of their documented shapes: only their calls are checked.
"""

from __future__ import annotations

import sys
import types

import torch

from mcore_npu.tools.gdn_cases import recurrent_rule


class Recorder:
    def __init__(self):
        self.calls: list[tuple[str, tuple, dict]] = []

    def record(self, name, args, kwargs):
        shapes = tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        self.calls.append((name, shapes, dict(kwargs)))

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls]


def install_torch_npu(monkeypatch) -> Recorder:
    rec = Recorder()
    module = types.ModuleType("torch_npu")

    def npu_chunk_gated_delta_rule(query, key, value, *, beta=None, initial_state=None,
                                   actual_seq_lengths=None, scale=None, g=None):  # fmt: skip
        rec.record("npu_chunk_gated_delta_rule", (query, key, value),
                   dict(beta=beta, initial_state=initial_state,
                        actual_seq_lengths=actual_seq_lengths, scale=scale, g=g))  # fmt: skip
        bounds = [0, *torch.cumsum(actual_seq_lengths.long(), 0).tolist()]
        state = initial_state.transpose(-1, -2).double()  # [B, Nv, Dk, Dv] for the oracle
        o, final = recurrent_rule(query[None], key[None], value[None], g[None], beta[None],
                                  initial_state=state, bounds=bounds, scale=scale)  # fmt: skip
        return o[0].to(value.dtype), final.transpose(-1, -2).to(initial_state.dtype)

    module.npu_chunk_gated_delta_rule = npu_chunk_gated_delta_rule
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return rec


def install_fla(monkeypatch) -> Recorder:
    from mcore_npu.ops.gated_delta import chunk_gated_delta_rule as ours

    rec = Recorder()

    def chunk_gated_delta_rule(q, k, v, g, beta, **kwargs):
        rec.record("chunk_gated_delta_rule", (q, k, v, g, beta), kwargs)
        return ours(q, k, v, g, beta, kernel="reference", **kwargs)

    names = ["fla", "fla.ops", "fla.ops.gated_delta_rule"]
    modules = [types.ModuleType(n) for n in names]
    modules[2].chunk_gated_delta_rule = chunk_gated_delta_rule
    for name, module in zip(names, modules):
        monkeypatch.setitem(sys.modules, name, module)
    return rec


def install_fla_npu(monkeypatch) -> Recorder:
    rec = Recorder()
    ops = types.ModuleType("fla_npu.ops.ascendc")
    for name, fn in _fla_npu_blocks().items():
        setattr(ops, name, _recording(rec, name, fn))
    for name, module in (("fla_npu", types.ModuleType("fla_npu")),
                         ("fla_npu.ops", types.ModuleType("fla_npu.ops")),
                         ("fla_npu.ops.ascendc", ops)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    return rec


def _recording(rec, name, fn):
    def op(*args, **kwargs):
        rec.record(name, args, kwargs)
        return fn(*args, **kwargs)

    return op


def _chunks(x, c):
    """``[B, H, T, ...]`` -> ``[B, H, NT, c, ...]`` (T a multiple of c in these tests)."""
    return x.unflatten(2, (x.shape[2] // c, c))


def _fla_npu_blocks():
    def cumsum(g, chunk_size, *, cu_seqlens=None, chunk_indices_out=None, reverse=False,
               head_first=True, **_):  # fmt: skip
        x = _chunks(g.float(), chunk_size)
        x = x.flip(-1).cumsum(-1).flip(-1) if reverse else x.cumsum(-1)
        return x.flatten(2, 3)

    def kkt(k, g, beta, *, cu_seqlens=None, chunk_indices=None, chunk_size=64):
        kc, gc, bc = (_chunks(t.float(), chunk_size) for t in (k, g, beta))
        decay = (gc[..., :, None] - gc[..., None, :]).tril(-1).exp().tril(-1)
        return (bc[..., None] * (kc @ kc.mT) * decay).flatten(2, 3)

    def solve_tri(x, *, cu_seqlens=None, chunk_indices=None, layout="bsnd"):
        assert layout == ("bsnd" if cu_seqlens is None else "tnd")
        if layout == "tnd":
            return solve_tri(x[None])[0]
        a = _chunks(x.transpose(1, 2).float(), x.shape[-1])  # [B, H, NT, C, C]
        eye = torch.eye(x.shape[-1])
        inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False)
        return inv.flatten(2, 3).transpose(1, 2).to(x.dtype)

    def recompute_w_u(k, v, beta, A, chunk_size, *, g=None, **_):
        a, kc, vc, bc, gc = (_chunks(t.float(), chunk_size) for t in (A, k, v, beta, g))
        w = a @ ((bc * gc.exp())[..., None] * kc)
        u = a @ (bc[..., None] * vc)
        return w.flatten(2, 3).to(k.dtype), u.flatten(2, 3).to(v.dtype)

    def fwd_h(k, w, u, g=None, *, initial_state=None, chunk_size=64, cu_seqlens=None, **_):
        """Segments must start on chunk boundaries here (the tests' packed case does)."""
        kc, wc, uc, gc = (_chunks(t.float(), chunk_size) for t in (k, w, u, g))
        b, hv, nt = kc.shape[:3]
        starts = [0] if cu_seqlens is None else list(cu_seqlens[:-1])
        assert all(s % chunk_size == 0 for s in starts)
        hs, news = [], []
        for j in range(nt):
            if j * chunk_size in starts:
                n = starts.index(j * chunk_size)
                state = torch.zeros(b, hv, k.shape[-1], u.shape[-1]) if initial_state is None else (
                    initial_state[n : n + 1].float())  # fmt: skip
            hs.append(state)
            new = uc[:, :, j] - wc[:, :, j] @ state
            news.append(new)
            last = gc[:, :, j, -1:]
            kd = kc[:, :, j] * (last - gc[:, :, j]).exp()[..., None]
            state = last.exp()[..., None] * state + kd.mT @ new
        h = torch.stack(hs, 2).to(k.dtype)
        return h, torch.stack(news, 2).flatten(2, 3).to(u.dtype), state

    def fwd_o(q, k, v, h, scale, *, g=None, chunk_size=64, **_):
        qc, kc, vc, gc = (_chunks(t.float(), chunk_size) for t in (q, k, v, g))
        qc = qc * scale
        decay = (gc[..., :, None] - gc[..., None, :]).tril().exp().tril()
        o = (qc * gc.exp()[..., None]) @ h.float() + ((qc @ kc.mT) * decay) @ vc
        return o.flatten(2, 3).to(v.dtype)

    def zeros_like(*shaped):
        return tuple(torch.zeros_like(t) for t in shaped)

    return {
        "npu_chunk_local_cumsum": cumsum,
        "npu_chunk_scaled_dot_kkt": kkt,
        "npu_solve_tri": solve_tri,
        "npu_recompute_w_u_fwd": recompute_w_u,
        "npu_chunk_gated_delta_rule_fwd_h": fwd_h,
        "npu_chunk_fwd_o": fwd_o,
        "npu_chunk_bwd_dv_local": lambda q, k, d_o, g, scale, c, **_: torch.zeros_like(d_o),
        "npu_chunk_gated_delta_rule_bwd_dhu": lambda q, k, w, d_o, dv, scale, c, **_: (
            torch.zeros(*q.shape[:2], q.shape[2] // c, q.shape[3], dv.shape[3]), None,
            torch.zeros_like(dv)),
        "npu_chunk_bwd_dqkwg": lambda q, k, v, g, h, do, dh, dv, c, **_: (
            *zeros_like(q, k), torch.zeros(*v.shape[:3], q.shape[3]), torch.zeros_like(g)),
        "npu_prepare_wy_repr_bwd_da": lambda k, v, beta, A, dw, du, g, **_: torch.zeros_like(A),
        "npu_prepare_wy_repr_bwd_full": lambda k, v, beta, A, dA, dw, du, g, c, **_: zeros_like(
            k, v, beta, g),
    }  # fmt: skip
