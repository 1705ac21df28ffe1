"""DeepSeek Sparse Attention's operators (``mcore_npu.ops.dsa``) against float64 oracles written
here one query at a time from the rule, the refusals (each naming the argument), and the contract
with torch_npu: no NPU here, so a stand-in ``torch_npu`` in ``sys.modules`` (``_StandIn``, a
stand-in for hardware we lack) records the calls and answers with the reference's numbers."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mcore_npu import ops
from mcore_npu.ops import dsa, probes, registry

NPU = types.SimpleNamespace(type="npu", index=0)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _problem(layout, *, lengths=(7, 10), n=4, d=8, dv=None, rope=0, seed=0, dtype=torch.float32):
    """query, key, weights (and value, query_rope, key_rope) for sequences of ``lengths``;
    BSND pads them to the longest. Continuous inputs (no score ties)."""
    g = _gen(seed)
    tokens = (len(lengths), max(lengths)) if layout == "BSND" else (sum(lengths),)

    def rand(*shape, shift=0.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) + shift).to(dtype)

    q, k = rand(*tokens, n, d, shift=0.3), rand(*tokens, 1, d, shift=0.3)
    w = rand(*tokens, n)
    v = rand(*tokens, 1, dv or d)
    qr, kr = (rand(*tokens, n, rope), rand(*tokens, 1, rope)) if rope else (None, None)
    if layout == "BSND":
        seq = list(lengths)
    else:
        seq = torch.tensor(lengths).cumsum(0).tolist()
    return dict(query=q, key=k, weights=w, value=v, query_rope=qr, key_rope=kr, lengths=seq)


def _sequences(layout, lengths, total):
    """[(batch, start, length)] as the operators read ``actual_seq_lengths``."""
    if layout == "BSND":
        return [(b, 0, n) for b, n in enumerate(lengths)]
    ends = [0, *lengths]
    return [(0, a, b - a) for a, b in zip(ends, ends[1:])]


def _rows(t, layout, b, start, n):
    return t[b, :n] if layout == "BSND" else t[start : start + n]


# ------------------------------------------------------------------------------- indexer oracle


def _indexer_oracle(p, layout, sparse_count, sparse_mode=3):
    """{(batch, start + i): (set of selected keys, sorted oracle scores)} per valid query."""
    found = {}
    for b, start, n in _sequences(layout, p["lengths"], None):
        q = _rows(p["query"], layout, b, start, n).double()
        k = _rows(p["key"], layout, b, start, n).double()[:, 0]
        w = _rows(p["weights"], layout, b, start, n).double()
        for i in range(n):
            visible = range(i + 1) if sparse_mode == 3 else range(n)
            scores = {j: sum(w[i, h].item() * max(0.0, (q[i, h] @ k[j]).item())
                             for h in range(q.shape[1])) for j in visible}  # fmt: skip
            ranked = sorted(scores, key=scores.get, reverse=True)
            top = ranked[:sparse_count]
            if len(ranked) > sparse_count:  # the data must not tie at the cut
                assert scores[ranked[sparse_count - 1]] - scores[ranked[sparse_count]] > 1e-6
            found[(b, start + i)] = (set(top), sorted(scores[j] for j in top))
    return found


@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("sparse_count", [3, 16])
def test_indexer_selects_the_oracles_top_keys_per_query_inside_its_sequence(layout, sparse_count):
    p = _problem(layout, lengths=(7, 10, 4))
    indices, values = ops.lightning_indexer(
        p["query"], p["key"], p["weights"], actual_seq_lengths_query=p["lengths"],
        actual_seq_lengths_key=p["lengths"], layout_query=layout, layout_key=layout,
        sparse_count=sparse_count, return_value=True)  # fmt: skip
    assert indices.dtype == torch.int32
    assert indices.shape == (*p["query"].shape[:-2], 1, sparse_count) == values.shape
    oracle = _indexer_oracle(p, layout, sparse_count)
    for (b, t), (expected, scores) in oracle.items():
        row = (indices[b, t, 0] if layout == "BSND" else indices[t, 0]).tolist()
        chosen = [j for j in row if j >= 0]
        assert set(chosen) == expected and len(chosen) == len(expected), (b, t)
        assert row[len(chosen) :] == [-1] * (sparse_count - len(chosen))  # padding at the end
        got = (values[b, t, 0] if layout == "BSND" else values[t, 0])[: len(chosen)]
        torch.testing.assert_close(got.double().sort().values, torch.tensor(scores,
                                   dtype=torch.float64), rtol=1e-5, atol=1e-5)  # fmt: skip


def test_indexer_indices_never_cross_a_packed_boundary_and_respect_causality():
    lengths = (5, 9, 3)
    p = _problem("TND", lengths=lengths, seed=3)
    indices, _ = ops.lightning_indexer(
        p["query"], p["key"], p["weights"], actual_seq_lengths_query=p["lengths"],
        actual_seq_lengths_key=torch.tensor(p["lengths"]), layout_query="TND", layout_key="TND",
        sparse_count=2048)  # fmt: skip
    for _, start, n in _sequences("TND", p["lengths"], None):
        for i in range(n):
            row = indices[start + i, 0]
            assert sorted(row[row >= 0].tolist()) == list(range(i + 1))  # all visible, no more


def test_indexer_sparse_mode_0_sees_every_key_and_blocks_match_one_block(monkeypatch):
    p = _problem("BSND", lengths=(9, 9), seed=5)
    common = dict(sparse_count=4, sparse_mode=0, return_value=True)
    oracle = _indexer_oracle(p, "BSND", 4, sparse_mode=0)
    whole = ops.lightning_indexer(p["query"], p["key"], p["weights"], **common)
    for (b, t), (expected, _) in oracle.items():
        assert set(whole[0][b, t, 0].tolist()) == expected
    monkeypatch.setattr(dsa.indexer, "QUERY_BLOCK", 2)  # several query blocks: the same answer
    blocked = ops.lightning_indexer(p["query"], p["key"], p["weights"], **common)
    assert torch.equal(blocked[0], whole[0])
    torch.testing.assert_close(blocked[1], whole[1], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- attention oracle


def _attention_oracle(q, k, v, idx, scale, layout, lengths, qr=None, kr=None, block=1, mode=3):
    """float64, one query and head at a time: softmax over the selected (and visible) keys."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=torch.float64)
    rows = []
    for b, start, n in _sequences(layout, lengths, None):
        for i in range(n):
            at = (b, i) if layout == "BSND" else (start + i,)
            base = 0 if layout == "BSND" else start
            keys = [j * block + o for j in idx[at][0].tolist() if j >= 0 for o in range(block)]
            keys = [j for j in keys if j < n and (mode == 0 or j <= i)]
            heads = []
            for h in range(q.shape[-2]):
                if not keys:
                    heads.append(torch.zeros(v.shape[-1], dtype=torch.float64))
                    continue
                kk = k[(b, keys) if layout == "BSND" else ([base + j for j in keys],)][:, 0]
                vv = v[(b, keys) if layout == "BSND" else ([base + j for j in keys],)][:, 0]
                s = kk.double() @ q[at][h].double()
                if qr is not None:
                    kkr = kr[(b, keys) if layout == "BSND" else ([base + j for j in keys],)]
                    s = s + kkr[:, 0].double() @ qr[at][h].double()
                heads.append(torch.softmax(s * scale, 0) @ vv.double())
            rows.append((at, torch.stack(heads)))
    return torch.stack([r for _, r in rows]), [at for at, _ in rows], out


def _valid(t, where):
    return torch.stack([t[at] for at in where])


def _close(actual, expected):
    """Within 1e-5 relative to the tensor's scale (fp32 against float64)."""
    scale = expected.abs().max().clamp_min(1e-30)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5 * scale.item())


@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("sparse_count", [3, 16])
def test_attention_output_and_gradients_match_the_float64_oracle(layout, sparse_count):
    p = _problem(layout, lengths=(6, 9), n=4, d=8, dv=8, rope=4, seed=1)
    lengths = p["lengths"]
    idx, _ = ops.lightning_indexer(
        p["query"], p["key"], p["weights"], actual_seq_lengths_query=lengths,
        actual_seq_lengths_key=lengths, layout_query=layout, layout_key=layout,
        sparse_count=sparse_count)  # fmt: skip
    leaves = [p[n].clone().requires_grad_() for n in ("query", "key", "value", "query_rope",
                                                        "key_rope")]  # fmt: skip
    scale = 0.3
    out, smax, ssum = ops.sparse_flash_attention(
        leaves[0], leaves[1], leaves[2], idx, scale, actual_seq_lengths_query=lengths,
        actual_seq_lengths_kv=lengths, query_rope=leaves[3], key_rope=leaves[4],
        layout_query=layout, layout_kv=layout, return_softmax_lse=True)  # fmt: skip
    doubles = [t.detach().double().requires_grad_() for t in leaves]
    expected, where, _ = _attention_oracle(doubles[0], doubles[1], doubles[2], idx, scale,
                                           layout, lengths, doubles[3], doubles[4])  # fmt: skip
    _close(_valid(out, where), expected.detach())
    cotangent = torch.randn(expected.shape, generator=_gen(7), dtype=torch.float64)
    (_valid(out, where).double() * cotangent).sum().backward()
    (expected * cotangent).sum().backward()
    for name, got, want in zip(("query", "key", "value", "query_rope", "key_rope"), leaves,
                               doubles):  # fmt: skip
        assert got.grad is not None, name
        _close(got.grad, want.grad)
    assert smax.dtype == ssum.dtype == torch.float32
    assert smax.shape == ((2, 1, 9, 4) if layout == "BSND" else (1, 15, 4)) == ssum.shape


def test_attention_blocks_of_keys_and_query_blocks_give_the_same_answer(monkeypatch):
    p = _problem("BSND", lengths=(10, 10), n=2, d=8, seed=2)
    block, count = 2, 3
    g = _gen(4)
    idx = torch.stack([torch.randperm(5, generator=g)[:count] for _ in range(20)]).view(2, 10, 1,
                                                                                     count)  # fmt: skip
    args = (p["query"], p["key"], p["value"], idx.int(), 0.5)
    out = ops.sparse_flash_attention(*args, sparse_block_size=block, sparse_mode=0)[0]
    expected, where, _ = _attention_oracle(p["query"], p["key"], p["value"], idx, 0.5, "BSND",
                                           p["lengths"], block=block, mode=0)  # fmt: skip
    _close(_valid(out, where), expected)
    monkeypatch.setattr(dsa.attention_reference, "QUERY_BLOCK", 3)  # several query blocks
    again = ops.sparse_flash_attention(*args, sparse_block_size=block, sparse_mode=0)[0]
    torch.testing.assert_close(again, out, rtol=1e-6, atol=1e-6)


def test_a_batch_without_keys_gets_zeros_and_no_indices():
    p = _problem("BSND", lengths=(4, 4), n=2, d=8)
    args = dict(actual_seq_lengths_query=[4, 4], sparse_count=3)
    idx, _ = ops.lightning_indexer(p["query"], p["key"], p["weights"],
                                   actual_seq_lengths_key=[4, 0], **args)  # fmt: skip
    assert (idx[1] == -1).all() and (idx[0] >= 0).any()
    out, _, _ = ops.sparse_flash_attention(
        p["query"], p["key"], p["value"], idx, 1.0, actual_seq_lengths_query=[4, 4],
        actual_seq_lengths_kv=[4, 0], sparse_mode=0)  # fmt: skip
    assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0


def test_a_query_with_no_selected_key_gets_zeros():
    p = _problem("TND", lengths=(4,), n=2, d=8)
    idx = torch.full((4, 1, 3), -1, dtype=torch.int32)
    out, _, _ = ops.sparse_flash_attention(p["query"], p["key"], p["value"], idx, 1.0,
                                           layout_query="TND", layout_kv="TND")  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out))


def test_key_passed_as_value_gets_both_gradients():
    """The DSA layer passes ``key`` as ``value``: one tensor's gradient is the sum of both."""
    p = _problem("BSND", lengths=(9, 9), n=4, d=8, rope=4, seed=3, dtype=torch.float64)
    idx = torch.randint(-1, 9, (2, 9, 1, 5), generator=_gen(5), dtype=torch.int32)
    cotangent = torch.randn(2, 9, 4, 8, generator=_gen(6), dtype=torch.float64)

    def grads(same):
        k, v = p["key"].clone().requires_grad_(), p["key"].clone().requires_grad_()
        q = p["query"].clone().requires_grad_()
        out = dsa.sparse_attention_reference(q, k, k if same else v, idx, 0.4,
                                             query_rope=p["query_rope"], key_rope=p["key_rope"])[0]  # fmt: skip
        (out * cotangent).sum().backward()
        return q.grad, k.grad, v.grad

    (q_same, k_same, v_unused), (q_two, k_two, v_two) = grads(True), grads(False)
    assert v_unused is None
    torch.testing.assert_close(q_same, q_two, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k_same, k_two + v_two, rtol=1e-12, atol=1e-12)


def test_attention_backward_recomputes_instead_of_keeping_the_gathered_keys():
    """S = 1024, top-k = 256, D = Dv = 32, rope 8: the gathered keys, values and key ropes of
    all queries take S * k * (D + Dv + rope) * 4 B = 72 MiB, all of which autograd through the
    gathers kept until the backward. Saved now: the inputs and the [S, N] softmax max and sum;
    forward + backward peaks at about one 128-query block's gathers and their gradients."""
    from mcore_npu.tools.bench.memory import track_allocations

    seq, top_k, heads, d, rope = 1024, 256, 4, 32, 8
    g = _gen(8)
    leaves = [torch.randn(1, seq, n, width, generator=g).requires_grad_()
              for n, width in ((heads, d), (1, d), (1, d), (heads, rope), (1, rope))]  # fmt: skip
    idx = torch.randint(0, seq, (1, seq, 1, top_k), generator=g, dtype=torch.int32)
    gathered = seq * top_k * (d + d + rope) * 4
    with track_allocations() as usage:
        out, _, _ = dsa.sparse_attention_reference(*leaves[:3], idx, 0.1, query_rope=leaves[3],
                                                   key_rope=leaves[4], sparse_mode=0)  # fmt: skip
        inputs = {t.data_ptr() for t in (*leaves, idx)}
        for saved in out.grad_fn.saved_tensors:
            if saved is not None:
                assert saved.data_ptr() in inputs or saved.numel() <= seq * heads, saved.shape
        out.backward(torch.ones_like(out))
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in leaves)
    assert usage.peak_bytes < gathered / 3, (usage.peak_bytes, gathered)


# ------------------------------------------------------------------------------------ refusals


def _indexer_call(**override):
    p = _problem("BSND", lengths=(5, 5))
    args = dict(query=p["query"], key=p["key"], weights=p["weights"], sparse_count=4)
    args.update(override)
    return ops.lightning_indexer(**args)


@pytest.mark.parametrize(("override", "error", "argument"), [
    ({"layout_query": "BNSD"}, ValueError, "layout_query"),
    ({"layout_key": "PA_BSND"}, ValueError, "layout_key"),
    ({"sparse_count": 0}, ValueError, "sparse_count"),
    ({"sparse_mode": 2}, ValueError, "sparse_mode"),
    ({"key": torch.randn(2, 5, 1, 6)}, ValueError, "key"),
    ({"key": torch.randn(2, 5, 2, 8)}, ValueError, "key"),
    ({"weights": torch.randn(2, 5, 3)}, ValueError, "weights"),
    ({"query": torch.randn(2, 5, 4, 8).int()}, TypeError, "query"),
    ({"actual_seq_lengths_query": [5, 9]}, ValueError, "actual_seq_lengths_query"),
])  # fmt: skip
def test_indexer_refusals_name_the_argument_and_the_fix(override, error, argument):
    with pytest.raises(error, match=f"^lightning_indexer: {argument}: (.|\n)*fix: "):
        _indexer_call(**override)


def _attention_call(**override):
    p = _problem("BSND", lengths=(5, 5), rope=4)
    args = dict(query=p["query"], key=p["key"], value=p["value"],
                sparse_indices=torch.zeros(2, 5, 1, 3, dtype=torch.int32), scale_value=0.5,
                query_rope=p["query_rope"], key_rope=p["key_rope"])  # fmt: skip
    args.update(override)
    return ops.sparse_flash_attention(**args)


@pytest.mark.parametrize(("override", "error", "argument"), [
    ({"layout_query": "SBH"}, ValueError, "layout_query"),
    ({"layout_kv": "TND"}, ValueError, "layout_kv"),
    ({"key": torch.randn(2, 5, 1, 6)}, ValueError, "key"),
    ({"key_rope": torch.randn(2, 5, 1, 2)}, ValueError, "key_rope"),
    ({"key_rope": None}, ValueError, "key_rope"),
    ({"value": torch.randn(2, 4, 1, 8)}, ValueError, "value"),
    ({"sparse_indices": torch.zeros(2, 5, 3, dtype=torch.int32)}, ValueError, "sparse_indices"),
    ({"sparse_indices": torch.zeros(2, 5, 1, 3)}, TypeError, "sparse_indices"),
    ({"sparse_block_size": 0}, ValueError, "sparse_block_size"),
    ({"scale_value": "0.5"}, TypeError, "scale_value"),
    ({"attention_mode": 5}, ValueError, "attention_mode"),
])  # fmt: skip
def test_attention_refusals_name_the_argument_and_the_fix(override, error, argument):
    with pytest.raises(error, match=f"^sparse_flash_attention: {argument}: (.|\n)*fix: "):
        _attention_call(**override)


# ------------------------------------------------------------------- the contract with torch_npu


class _StandIn(types.ModuleType):
    """A stand-in torch_npu (hardware we lack): records each call, answers with the reference
    (the grad op by autograd through it)."""

    def __init__(self):
        super().__init__("torch_npu")
        self.calls = []
        self.npu = types.SimpleNamespace(get_soc_version=lambda: 225)

    def npu_lightning_indexer(self, query, key, weights, *, actual_seq_lengths_query=None,
                              actual_seq_lengths_key=None, block_table=None, layout_query="BSND",
                              layout_key="BSND", sparse_count=2048, sparse_mode=3,
                              pre_tokens=2**63 - 1, next_tokens=2**63 - 1, return_value=False):  # fmt: skip
        kwargs = dict(actual_seq_lengths_query=actual_seq_lengths_query,
                      actual_seq_lengths_key=actual_seq_lengths_key, layout_query=layout_query,
                      layout_key=layout_key, sparse_count=sparse_count, sparse_mode=sparse_mode,
                      return_value=return_value)  # fmt: skip
        self.calls.append(("npu_lightning_indexer", (query, key, weights), kwargs))
        return dsa.indexer_reference(query, key, weights, **kwargs)

    def npu_sparse_flash_attention(self, query, key, value, sparse_indices, scale_value, *,
                                   block_table=None, actual_seq_lengths_query=None,
                                   actual_seq_lengths_kv=None, query_rope=None, key_rope=None,
                                   sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                                   sparse_mode=3, pre_tokens=2**63 - 1, next_tokens=2**63 - 1,
                                   attention_mode=0, return_softmax_lse=False):  # fmt: skip
        kwargs = dict(actual_seq_lengths_query=actual_seq_lengths_query,
                      actual_seq_lengths_kv=actual_seq_lengths_kv, query_rope=query_rope,
                      key_rope=key_rope, sparse_block_size=sparse_block_size,
                      layout_query=layout_query, layout_kv=layout_kv, sparse_mode=sparse_mode,
                      attention_mode=attention_mode, return_softmax_lse=return_softmax_lse)  # fmt: skip
        self.calls.append(("npu_sparse_flash_attention", (query, key, value, sparse_indices,
                                                          scale_value), kwargs))  # fmt: skip
        with torch.no_grad():
            return dsa.sparse_attention_reference(query, key, value, sparse_indices,
                                                  scale_value, **kwargs)  # fmt: skip

    def npu_sparse_flash_attention_grad(self, query, key, value, sparse_indices, d_out, out,
                                        softmax_max, softmax_sum, scale_value, sparse_block_size,
                                        *, query_rope=None, key_rope=None, actual_seq_qlen=None,
                                        actual_seq_kvlen=None, layout="BSND", sparse_mode=3,
                                        pre_tokens=2**63 - 1, next_tokens=2**63 - 1,
                                        attention_mode=0):  # fmt: skip
        kwargs = dict(query_rope=query_rope, key_rope=key_rope, actual_seq_qlen=actual_seq_qlen,
                      actual_seq_kvlen=actual_seq_kvlen, layout=layout, sparse_mode=sparse_mode,
                      attention_mode=attention_mode)  # fmt: skip
        self.calls.append(("npu_sparse_flash_attention_grad", (query, key, value, sparse_indices,
                           d_out, out, softmax_max, softmax_sum, scale_value,
                           sparse_block_size), kwargs))  # fmt: skip
        leaves = [t.detach().requires_grad_() for t in (query, key, value, query_rope, key_rope)]
        with torch.enable_grad():
            o = dsa.sparse_attention_reference(
                *leaves[:3], sparse_indices, scale_value, query_rope=leaves[3],
                key_rope=leaves[4], sparse_block_size=sparse_block_size, layout_query=layout,
                layout_kv=layout, sparse_mode=sparse_mode, actual_seq_lengths_query=actual_seq_qlen,
                actual_seq_lengths_kv=actual_seq_kvlen)[0]  # fmt: skip
            return torch.autograd.grad(o, leaves, d_out)


@pytest.fixture
def standin(monkeypatch):
    module = _StandIn()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


def test_indexer_passes_torch_npus_keywords_and_the_lengths_as_tensors(standin):
    g = _gen(0)
    q = torch.randn(6, 64, 128, generator=g).bfloat16()
    k, w = torch.randn(6, 1, 128, generator=g).bfloat16(), torch.randn(6, 64, generator=g)
    got = ops.lightning_indexer(q, k, w.bfloat16(), actual_seq_lengths_query=[2, 6],
                                actual_seq_lengths_key=[2, 6], layout_query="TND",
                                layout_key="TND", sparse_count=4, kernel="torch_npu")  # fmt: skip
    ((name, args, kwargs),) = standin.calls
    assert name == "npu_lightning_indexer" and args[0] is q and args[1] is k
    assert kwargs["actual_seq_lengths_query"].tolist() == [2, 6]
    assert {k: v for k, v in kwargs.items() if not k.startswith("actual")} == dict(
        layout_query="TND", layout_key="TND", sparse_count=4, sparse_mode=3, return_value=False
    )
    assert got[0].shape == (6, 1, 4)


def test_attention_calls_the_fused_pair_with_the_documented_arguments(standin):
    g = _gen(0)
    q = torch.randn(1, 4, 2, 512, generator=g).bfloat16().requires_grad_()
    kv = torch.randn(1, 4, 1, 512, generator=g).bfloat16().requires_grad_()
    qr = torch.randn(1, 4, 2, 64, generator=g).bfloat16().requires_grad_()
    kr = torch.randn(1, 4, 1, 64, generator=g).bfloat16().requires_grad_()
    idx = torch.tensor([[0, -1], [1, 0], [2, 1], [3, 2]], dtype=torch.int32).view(1, 4, 1, 2)
    out, smax, _ = ops.sparse_flash_attention(q, kv, kv, idx, 0.04, query_rope=qr, key_rope=kr,
                                              kernel="torch_npu")  # fmt: skip
    out.float().sum().backward()
    names = [c[0] for c in standin.calls]
    assert names == ["npu_sparse_flash_attention", "npu_sparse_flash_attention_grad"]
    forward, backward = standin.calls[0][2], standin.calls[1][2]
    assert forward["attention_mode"] == 2 and forward["return_softmax_lse"] is True
    assert forward["sparse_mode"] == 3 and forward["query_rope"] is qr
    assert backward["layout"] == "BSND" and backward["attention_mode"] == 2
    assert smax.numel() == 0  # return_softmax_lse=False: the stats are not handed back
    assert kv.grad is not None and qr.grad is not None and kr.grad is not None


def test_auto_falls_back_where_the_fused_attention_limits_are_not_met(standin, monkeypatch):
    """Head dim 8 (the kernel takes 512 + 64): auto on an NPU runs the reference and warns
    once, naming the limit; asking for torch_npu by name raises with the same reason."""
    p = _problem("BSND", lengths=(4,), n=3, d=8, rope=4)
    facts = dict(query=p["query"].bfloat16(), key=p["key"], query_rope=p["query_rope"])
    with pytest.warns(UserWarning, match="sparse_flash_attention: using the PyTorch reference "
                      r"on the NPU \(torch_npu: it takes D = 512, got D = 8\)"):  # fmt: skip
        assert registry.resolve("sparse_flash_attention", "auto", NPU, **facts).kernel == (
            "reference"
        )
    with pytest.raises(ValueError, match="kernel 'torch_npu' cannot run this call: .*D = 512"):
        registry.resolve("sparse_flash_attention", "torch_npu", NPU, **facts)
    three_heads = dict(query=torch.zeros(1, 1, 3, 512, dtype=torch.bfloat16),
                       key=torch.zeros(1, 1, 1, 512), query_rope=torch.zeros(1, 1, 3, 64))  # fmt: skip
    assert "power-of-two" in probes.sparse_flash_attention(None, **three_heads)
    assert "one KV head" in probes.sparse_flash_attention(None, query=three_heads["query"],
                                                key=torch.zeros(1, 1, 2, 512))  # fmt: skip
    assert "exactly 64" in probes.lightning_indexer(None, query=torch.zeros(2, 32, 128).half(),
                                             layout="TND")  # fmt: skip
    assert standin.calls == []


def test_the_fused_kl_loss_takes_one_ranks_heads_only(standin, monkeypatch):
    """The fused KL loss sums the attention of the heads it is given: with the heads split over
    ranks (``heads_split``, what the DSA layer reports under TP) auto takes the reference (whose
    ``head_group`` all-reduces the head sums) and torch_npu by name is refused, naming why."""
    monkeypatch.setattr(
        standin, "npu_sparse_lightning_indexer_grad_kl_loss", lambda *a, **k: a, raising=False
    )  # the kernel we lack: present, never called here
    facts = dict(query=torch.zeros(1, 1, 32, 512, dtype=torch.bfloat16),
                 query_index=torch.zeros(1, 1, 8, 128), query_rope=torch.zeros(1, 1, 32, 64),
                 sparse_count=2048)  # fmt: skip
    assert registry.resolve(dsa.KL_LOSS, "torch_npu", NPU, **facts).kernel == "torch_npu"
    with pytest.warns(UserWarning, match="under tensor parallelism the target sums every rank"):
        assert (
            registry.resolve(dsa.KL_LOSS, "auto", NPU, heads_split=True, **facts).kernel
            == "reference"
        )
    with pytest.raises(ValueError, match="cannot run this call: .*sums one rank's heads"):
        registry.resolve(dsa.KL_LOSS, "torch_npu", NPU, heads_split=True, **facts)
    assert standin.calls == []


# -------------------------------------------------------------------------- the indexer's KL loss


def _kl_oracle(p, qi, ki, w, idx, scale, layout, lengths):
    """float64, one query at a time: KL(sum-over-heads attention, L1-normalized || softmax of
    the indexer scores) over the selected visible keys, summed over the queries."""
    total = torch.zeros((), dtype=torch.float64)
    for b, start, n in _sequences(layout, lengths, None):
        for i in range(n):
            at = (b, i) if layout == "BSND" else (start + i,)
            base = 0 if layout == "BSND" else start
            keys = [j for j in idx[at][0].tolist() if 0 <= j <= i]
            if not keys:
                continue
            rows = (b, keys) if layout == "BSND" else ([base + j for j in keys],)
            k, kr, kk = p["key"][rows][:, 0], p["key_rope"][rows][:, 0], ki[rows][:, 0]
            q, qr = p["query"][at].double(), p["query_rope"][at].double()
            main = (q @ k.double().T + qr @ kr.double().T) * scale  # [N, M]
            target = torch.softmax(main, -1).sum(0)
            target = target / target.sum()
            scores = (w[at][:, None] * (qi[at] @ kk.T).relu()).sum(0)
            total = total + (target * (target.log() - torch.log_softmax(scores, 0))).sum()
    return total


@pytest.mark.parametrize("layout", ["BSND", "TND"])
@pytest.mark.parametrize("sparse_count", [3, 16])
def test_indexer_kl_loss_and_its_gradients_match_the_float64_oracle(layout, sparse_count):
    p = _problem(layout, lengths=(6, 9), n=4, d=8, rope=4, seed=11)
    lengths = p["lengths"]
    g = _gen(12)
    tokens = p["query"].shape[:-2]
    qi, ki = torch.randn(*tokens, 2, 6, generator=g), torch.randn(*tokens, 1, 6, generator=g)
    w = torch.randn(*tokens, 2, generator=g)
    idx, _ = ops.lightning_indexer(qi, ki, w, actual_seq_lengths_query=lengths,
                                   actual_seq_lengths_key=lengths, layout_query=layout,
                                   layout_key=layout, sparse_count=sparse_count)  # fmt: skip
    d_qi, d_ki, d_w, loss = ops.sparse_lightning_indexer_grad_kl_loss(
        p["query"], p["key"], qi, ki, w, idx, None, None, 0.4, query_rope=p["query_rope"],
        key_rope=p["key_rope"], actual_seq_qlen=lengths, actual_seq_klen=lengths,
        layout=layout)  # fmt: skip
    doubles = [t.double().requires_grad_() for t in (qi, ki, w)]
    expected = _kl_oracle(p, *doubles, idx, 0.4, layout, lengths)
    expected.backward()
    assert loss.shape == (1,) and loss.dtype == torch.float32 and expected.item() > 0
    _close(loss[0], expected.detach())
    for got, want in zip((d_qi, d_ki, d_w), doubles):
        _close(got, want.grad)


def test_indexer_kl_loss_refusals_name_the_argument():
    p = _problem("BSND", lengths=(4, 4), rope=4)
    qi, ki, w = torch.randn(2, 4, 2, 6), torch.randn(2, 4, 1, 6), torch.randn(2, 4, 2)
    idx = torch.zeros(2, 4, 1, 3, dtype=torch.int32)
    call = (p["query"], p["key"], qi, ki, w, idx, None, None, 0.4)
    kl = ops.sparse_lightning_indexer_grad_kl_loss
    with pytest.raises(ValueError, match="^sparse_lightning_indexer_grad_kl_loss: layout: "):
        kl(*call, layout="BNSD")
    with pytest.raises(ValueError, match="^sparse_lightning_indexer_grad_kl_loss: key_index: "):
        kl(*call[:3], torch.randn(2, 4, 1, 5), *call[4:])
    with pytest.raises(ValueError, match="^sparse_lightning_indexer_grad_kl_loss: key_rope: "):
        kl(*call, query_rope=p["query_rope"])


def test_indexer_kl_loss_calls_torch_npu_with_its_keywords(standin, monkeypatch):
    recorded = []

    def kl_stand_in(*args, **kwargs):  # hardware we lack: record, answer with the reference
        recorded.append((args, kwargs))
        return dsa.indexer_kl_loss_reference(*args, **kwargs)

    monkeypatch.setattr(standin, "npu_sparse_lightning_indexer_grad_kl_loss", kl_stand_in,
                        raising=False)  # fmt: skip
    g = _gen(0)
    q, k = torch.randn(1, 2, 32, 512, generator=g).half(), torch.randn(1, 2, 1, 512).half()
    qr, kr = torch.randn(1, 2, 32, 64).half(), torch.randn(1, 2, 1, 64).half()
    qi, ki, w = (
        torch.randn(1, 2, 8, 16).half(),
        torch.randn(1, 2, 1, 16).half(),
        torch.randn(1, 2, 8),
    )
    idx = torch.full((1, 2, 1, 1024), -1, dtype=torch.int32)
    idx[0, :, 0, 0] = 0
    out = ops.sparse_lightning_indexer_grad_kl_loss(
        q, k, qi, ki, w.half(), idx, None, None, 0.04, query_rope=qr, key_rope=kr,
        actual_seq_qlen=[2], actual_seq_klen=[2], kernel="torch_npu")  # fmt: skip
    ((args, kwargs),) = recorded
    assert args[0] is q and args[8] == 0.04 and kwargs["layout"] == "BSND"
    assert kwargs["actual_seq_qlen"].tolist() == [2] and kwargs["query_rope"] is qr
    assert len(out) == 4 and out[3].shape == (1,)
