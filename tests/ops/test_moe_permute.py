"""The MoE token permute operators: references against Megatron-Core's unfused ``permute`` /
``unpermute`` (bit-exact, forward and gradients), the legacy index pair against a float64
oracle, every refusal by its message, and the dispatch (a stand-in torch_npu, no NPU here:
``tests/fused_standin.py`` records the calls and answers with the reference)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from mcore_npu import ops
from mcore_npu.ops import reference
from mcore_npu.ops.registry import resolve
from tests.fused_standin import install

T, H, E = 12, 8, 4


def _routing(kind: str, seed: int = 0):
    """tokens [T, H], routing_map [T, E] (True = routed), probs [T, E]."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(T, H, generator=gen)
    probs = torch.rand(T, E, generator=gen)
    if kind == "top2":
        top = torch.rand(T, E, generator=gen).topk(2, dim=1).indices
        routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, top, True)
    elif kind == "uneven":  # some tokens go nowhere (another rank's experts), expert 2 idle
        routing_map = torch.rand(T, E, generator=gen) > 0.6
        routing_map[:, 2] = False
        routing_map[0] = False
    else:  # "capacity": every expert holds exactly 3 tokens (drop_and_pad)
        routing_map = torch.zeros(T, E, dtype=torch.bool)
        for e in range(E):
            routing_map[torch.randperm(T, generator=gen)[:3], e] = True
    return tokens, routing_map, probs


def _leaves(*tensors, dtype=torch.float32):
    return [t.detach().to(dtype).clone().requires_grad_(True) for t in tensors]


def _round_trip(permute_fn, unpermute_fn, tokens, routing_map, probs, drop_and_pad, probs_back):
    """Permute with probs, scale the rows, unpermute (optionally weighted): outputs and grads."""
    x, p = _leaves(tokens, probs, dtype=tokens.dtype)
    # the routed pairs (megatron-core 0.18+'s argsort permute requires the count; 0.16 ignores
    # it without drop_and_pad); 0.19+ returns two more values (fused padding's), None here
    count = 3 * E if drop_and_pad else int(routing_map.sum())
    rows, row_probs, indices = permute_fn(x, routing_map, probs=p, num_out_tokens=count,
                                          drop_and_pad=drop_and_pad)[:3]  # fmt: skip
    scaled = rows * row_probs.unsqueeze(-1).to(rows.dtype)
    out = unpermute_fn(scaled, indices, x.shape, probs=p if probs_back else None,
                       routing_map=routing_map, drop_and_pad=drop_and_pad)  # fmt: skip
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    (out * upstream).sum().backward()
    return rows.detach(), row_probs.detach(), indices, out.detach(), x.grad, p.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("probs_back", [False, True])
@pytest.mark.parametrize("kind", ["top2", "uneven", "capacity"])
def test_routing_map_pair_equals_megatrons_unfused_permute_bit_for_bit(kind, probs_back, dtype):
    tokens, routing_map, probs = _routing(kind)
    tokens, probs = tokens.to(dtype), probs.to(dtype)
    drop_and_pad = kind == "capacity"
    got = _round_trip(ops.moe_token_permute_with_routing_map,
                      lambda *a, **k: ops.moe_token_unpermute_with_routing_map(
                          *a, **k, kernel="reference"),
                      tokens, routing_map, probs, drop_and_pad, probs_back)  # fmt: skip
    want = _round_trip(permute, unpermute, tokens, routing_map, probs, drop_and_pad, probs_back)
    names = ("permuted", "permuted_probs", "sorted_indices", "unpermuted", "d tokens", "d probs")
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), name
    assert got[0].shape[0] == (3 * E if drop_and_pad else int(routing_map.sum()))


def test_permuted_rows_are_grouped_by_expert_in_token_order():
    tokens = torch.arange(4.0).view(4, 1)
    routing_map = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 0, 0], [0, 0, 1]]).bool()
    rows, _, indices = reference.npu_moe_token_permute_with_routing_map(tokens, routing_map)
    assert rows.view(-1).tolist() == [0.0, 2.0, 0.0, 1.0, 3.0]  # expert 0: t0, t2; 1: -; 2: ...
    assert indices.tolist() == [0, 2, 0, 1, 3]
    back = reference.npu_moe_token_unpermute_with_routing_map(rows, indices, (4, 1))
    assert back.view(-1).tolist() == [0.0, 1.0, 2.0, 3.0]  # t0 twice: 2 * 0


def _legacy_oracle(tokens, indices, probs, num_out):
    """float64, by explicit loops: pairs (t, k) sorted stably by expert, cut to num_out rows;
    unpermute = sum over the kept pairs of a token, weighted by probs."""
    tokens, probs = tokens.double(), probs.double()
    k = indices.shape[1]
    pairs = sorted(range(indices.numel()), key=lambda i: (int(indices.view(-1)[i]), i))[:num_out]
    rows = torch.stack([tokens[i // k] for i in pairs])
    out = torch.zeros_like(tokens)
    for r, i in enumerate(pairs):
        out[i // k] += rows[r] * probs[i // k, i % k]
    return rows, out


@pytest.mark.parametrize("num_out", [None, 17])
def test_legacy_index_pair_against_a_float64_oracle(num_out):
    gen = torch.Generator().manual_seed(3)
    tokens, probs = torch.randn(T, H, generator=gen), torch.rand(T, 2, generator=gen)
    indices = torch.rand(T, E, generator=gen).topk(2, dim=1).indices.to(torch.int32)
    x, p = _leaves(tokens, probs)
    rows, sorted_indices = ops.moe_token_permute(x, indices, num_out, kernel="reference")
    out = ops.moe_token_unpermute(rows, sorted_indices, p, kernel="reference")
    want_rows, want_out = _legacy_oracle(tokens, indices, probs, num_out or 2 * T)
    torch.testing.assert_close(rows.double(), want_rows, rtol=0, atol=0)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-6, atol=1e-6)
    xo, po = _leaves(tokens, probs, dtype=torch.float64)
    _, oracle_out = _legacy_oracle(xo, indices, po, num_out or 2 * T)
    upstream = torch.randn(T, H, generator=gen)
    out.backward(upstream)
    oracle_out.backward(upstream.double())
    torch.testing.assert_close(x.grad.double(), xo.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p.grad.double(), po.grad, rtol=1e-6, atol=1e-6)


def test_legacy_unpermute_without_probs_restores_one_choice_per_token():
    tokens = torch.randn(5, 3)
    indices = torch.tensor([3, 0, 2, 0, 1])
    rows, sorted_indices = reference.npu_moe_token_permute(tokens, indices)
    assert rows[:, 0].tolist() == tokens[[1, 3, 4, 2, 0], 0].tolist()
    back = reference.npu_moe_token_unpermute(rows, sorted_indices, restore_shape=(5, 3))
    assert torch.equal(back, tokens)


# ------------------------------------------------------------------------------- refusals

_X, _MAP, _P = _routing("top2")
PERMUTE_BAD = [
    (dict(tokens=_X.long()), TypeError, "tokens: dtype torch.int64 is not supported"),
    (dict(tokens=_X[None]), ValueError, "tokens: must be 2-D, got rank 3"),
    (dict(routing_map=_MAP.float()), TypeError, "routing_map: dtype torch.float32 is not bool"),
    (dict(routing_map=_MAP[:5]), ValueError, "routing_map: has 5 rows for 12 tokens"),
    (dict(routing_map=[[True]]), TypeError, "routing_map: expected a bool tensor, got list"),
    (dict(probs=_P[:, :3]), ValueError, "probs: shape [12, 3] is not [12, 4]"),
    (dict(probs=_P.long()), TypeError, "probs: dtype torch.int64 is not supported"),
    (dict(drop_and_pad=1), TypeError, "drop_and_pad: expected a bool, got int"),
    (dict(num_out_tokens=2.5), TypeError, "num_out_tokens: expected an int or None, got float"),
    (dict(num_out_tokens=-1), ValueError, "num_out_tokens: -1 is negative"),
    (dict(drop_and_pad=True), ValueError, "num_out_tokens: None is not a multiple of the 4"),
    (dict(drop_and_pad=True, num_out_tokens=10), ValueError, "10 is not a multiple of the 4"),
    (dict(drop_and_pad=True, num_out_tokens=4 * 13), ValueError, "capacity of 13 exceeds"),
]


@pytest.mark.parametrize("change, exc, message", PERMUTE_BAD, ids=[m for *_, m in PERMUTE_BAD])
def test_permute_refusals_name_the_argument_and_the_fix(change, exc, message):
    args = dict(tokens=_X, routing_map=_MAP, probs=_P)
    args.update(change)
    tokens, routing_map = args.pop("tokens"), args.pop("routing_map")
    with pytest.raises(exc) as info:
        ops.moe_token_permute_with_routing_map(tokens, routing_map, **args, kernel="reference")
    text = str(info.value)
    assert text.startswith("npu_moe_token_permute_with_routing_map: ") and message in text
    assert "fix: " in text


_ROWS, _, _IDX = reference.npu_moe_token_permute_with_routing_map(_X, _MAP)
UNPERMUTE_BAD = [
    (dict(sorted_indices=_IDX.float()), TypeError, "sorted_indices: expected an int32 / int64"),
    (dict(sorted_indices=_IDX[:3]), ValueError, "sorted_indices: has 3 entries for 24"),
    (dict(restore_shape=(12,)), TypeError, "restore_shape: expected two ints [T, H]"),
    (dict(restore_shape=(12, 5)), ValueError, "restore_shape: [12, 5] does not fit"),
    (dict(probs=_P), ValueError, "routing_map: is None but probs are given"),
    (dict(probs=_P[:, :2], routing_map=_MAP), ValueError, "probs: shape [12, 2] is not"),
    (dict(routing_map=_MAP[:4]), ValueError, "routing_map: has 4 rows for 12 tokens"),
    (dict(permuted_tokens=_ROWS.half()[:, :1].expand(24, H).int()), TypeError,
     "permuted_tokens: dtype torch.int32"),
    (dict(permuted_tokens=_ROWS[:22], sorted_indices=_IDX[:22], probs=_P, routing_map=_MAP,
          drop_and_pad=True), ValueError, "22 rows are not a multiple of the 4 experts"),
]  # fmt: skip


@pytest.mark.parametrize("change, exc, message", UNPERMUTE_BAD,
                         ids=[m for *_, m in UNPERMUTE_BAD])  # fmt: skip
def test_unpermute_refusals_name_the_argument_and_the_fix(change, exc, message):
    args = dict(permuted_tokens=_ROWS, sorted_indices=_IDX, restore_shape=(T, H))
    args.update(change)
    positional = [args.pop(n) for n in ("permuted_tokens", "sorted_indices", "restore_shape")]
    with pytest.raises(exc) as info:
        ops.moe_token_unpermute_with_routing_map(*positional, **args, kernel="reference")
    text = str(info.value)
    assert text.startswith("npu_moe_token_unpermute_with_routing_map: ") and message in text
    assert "fix: " in text


def test_legacy_refusals():
    indices = torch.zeros(T, 2, dtype=torch.int64)
    cases = [
        (lambda: ops.moe_token_permute(_X, indices, padded_mode=True), ValueError,
         "npu_moe_token_permute: padded_mode: True is not implemented"),
        (lambda: ops.moe_token_permute(_X, indices.float()), TypeError,
         "npu_moe_token_permute: indices: expected an int32 / int64 tensor"),
        (lambda: ops.moe_token_permute(_X, indices[:3]), ValueError,
         "indices: has 3 entries for 12"),
        (lambda: ops.moe_token_permute(_X, indices, 25), ValueError,
         "num_out_tokens: 25 exceeds the 24"),
        (lambda: ops.moe_token_unpermute(_X, torch.arange(T), padded_mode=True), ValueError,
         "npu_moe_token_unpermute: padded_mode: True is not implemented"),
        (lambda: ops.moe_token_unpermute(_X, torch.arange(T), _P[:, 0]), ValueError,
         "probs: must be 2-D [T, K]"),
        (lambda: ops.moe_token_unpermute(_X, torch.arange(T), restore_shape=(3, H)), ValueError,
         "restore_shape: 3 rows, but the call restores 12"),
    ]  # fmt: skip
    for call, exc, message in cases:
        with pytest.raises(exc) as info:
            call()
        assert message in str(info.value) and "fix: " in str(info.value), message


def test_float64_is_for_the_reference_only(monkeypatch):
    install(monkeypatch)
    with pytest.raises(TypeError, match="float64: reference kernel only"):
        ops.moe_token_permute_with_routing_map(_X.double(), _MAP, kernel="torch_npu")


# ------------------------------------------------------------------------------- dispatch


def test_torch_npu_kernel_calls_both_operators_with_the_documented_arguments(monkeypatch):
    standin = install(monkeypatch)
    x, p = _leaves(_X, _P)
    rows, row_probs, idx = ops.moe_token_permute_with_routing_map(x, _MAP, probs=p,
                                                                 num_out_tokens=24,
                                                                 kernel="torch_npu")  # fmt: skip
    out = ops.moe_token_unpermute_with_routing_map(rows, idx, x.shape, probs=p, routing_map=_MAP,
                                                   kernel="torch_npu")  # fmt: skip
    out.sum().backward()
    assert standin.names() == ["npu_moe_token_permute_with_routing_map",
                               "npu_moe_token_unpermute_with_routing_map"]  # fmt: skip
    (_, (tokens, routing_map), kw1), (_, (permuted, indices, shape), kw2) = standin.calls
    assert tokens is x and routing_map is _MAP
    assert kw1 == {"probs": p, "num_out_tokens": 24, "drop_and_pad": False}
    assert permuted is rows and indices is idx and tuple(shape) == (T, H)
    assert kw2 == {"probs": p, "routing_map": _MAP, "drop_and_pad": False}
    assert x.grad is not None and p.grad is not None


def test_torch_npu_kernel_calls_the_legacy_pair(monkeypatch):
    standin = install(monkeypatch)
    indices = torch.zeros(T, 2, dtype=torch.int32)
    rows, idx = ops.moe_token_permute(_X, indices, kernel="torch_npu")
    ops.moe_token_unpermute(rows, idx, _P[:, :2], kernel="torch_npu")
    assert standin.calls[0][2] == {"num_out_tokens": None, "padded_mode": False}
    assert standin.calls[1][2] == {"probs": standin.calls[1][2]["probs"], "padded_mode": False,
                                   "restore_shape": None}  # fmt: skip
    assert standin.names() == ["npu_moe_token_permute", "npu_moe_token_unpermute"]


PERMUTE = "moe_token_permute_with_routing_map"


def test_auto_on_an_npu_without_the_operators_falls_back_with_one_warning(monkeypatch):
    """The registry's policy for the permute pair. A device object of type "npu" stands in for
    NPU tensors (only ``.type`` is read)."""
    install(monkeypatch, routing_map_ops=False)
    npu = types.SimpleNamespace(type="npu")
    with pytest.warns(UserWarning, match="no npu_moe_token_permute_with_routing_map") as record:
        assert resolve(PERMUTE, "auto", npu).kernel == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(PERMUTE, "auto", npu).fell_back  # no second warning
    assert len(record) == 1
    with pytest.raises(ValueError, match="kernel 'torch_npu' cannot run this call: the installed "
                       "torch_npu has no npu_moe_token_perm"):  # fmt: skip
        resolve(PERMUTE, "torch_npu", npu)
    assert resolve(PERMUTE, "reference", npu).kernel == "reference"


def test_auto_on_an_npu_with_the_operators_takes_them(monkeypatch):
    install(monkeypatch)
    for name in (PERMUTE, "moe_token_unpermute_with_routing_map", "moe_token_permute",
                 "moe_token_unpermute"):  # fmt: skip
        assert resolve(name, "auto", types.SimpleNamespace(type="npu")).kernel == "torch_npu"
        assert resolve(name, "auto", torch.device("cpu")).kernel == "reference"
