"""The DeepSeek Sparse Attention table's cases (``specs/dsa_cases.yaml``) and their float64
oracles.

``make_call`` draws a case's seeded inputs (for attention also its indices: distinct random
visible blocks per query and KV head). The oracles run the definitions in float64 sharing no
code with ``mcore_npu.ops``: the indexer scores every visible key, ``sum_h w_h relu(q_h . k)``,
and keeps the top ones as a set per query; attention is dense masked softmax attention whose
mask keeps only the selected keys. ``check_reference_dsa_case`` compares the reference with
them, ``check_kernel_dsa_case`` the kernel ``auto`` picks on the device with the float32
reference.
"""

from __future__ import annotations

import itertools

import torch

from mcore_npu.tools.cases import DSA_TABLE, DsaCase, load_table
from mcore_npu.tools.comparison import CaseResult, Comparison, compare, compare_outputs, normal

OPERATORS = DsaCase.operators
QUANTITIES = DsaCase.quantities


def load_dsa_cases(path=None) -> list[DsaCase]:
    return load_table(path or DSA_TABLE)


# --------------------------------------------------------------------------------------- inputs


def segments(case: DsaCase) -> list[tuple[int, int, int, int, int]]:
    """``[(batch, q_start, q_len, kv_start, kv_len)]``: the case's sequences."""
    if case.param("layout") == "TND":
        pairs = case.param("segments")
        q0 = itertools.accumulate((q for q, _ in pairs), initial=0)
        k0 = itertools.accumulate((k for _, k in pairs), initial=0)
        return [(0, a, q, b, k) for a, b, (q, k) in zip(q0, k0, pairs)]
    lengths = case.param("lengths") or [case.param("seq")] * case.param("batch")
    return [(b, 0, q, 0, k) for b, (q, k) in enumerate(lengths)]


def _tokens(case: DsaCase) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The leading dims of query-side and key-side tensors: ``(B, S)`` or ``(T,)``."""
    if case.param("layout") == "TND":
        pairs = case.param("segments")
        return (sum(q for q, _ in pairs),), (sum(k for _, k in pairs),)
    b, (sq, skv) = case.param("batch"), case.param("seq")
    return (b, sq), (b, skv)


def _rows(t, layout, batch, start, length):
    """One sequence's ``[length, ...]`` rows of ``t``."""
    return t[batch, :length] if layout == "BSND" else t[start : start + length]


def _length_args(case: DsaCase):
    """``(actual_seq_lengths_query, actual_seq_lengths_kv)`` as the operators take them."""
    spans = segments(case)
    if case.param("layout") == "TND":
        return [a + q for _, a, q, _, _ in spans], [b + k for _, _, _, b, k in spans]
    if case.param("lengths") is None:
        return None, None
    return [q for _, _, q, _, _ in spans], [k for _, _, _, _, k in spans]


def _visible(mode, i, sq, skv) -> int:
    """How many keys (from 0) query ``i`` of a ``sq``-query, ``skv``-key sequence may see."""
    return skv if mode == 0 else max(0, min(skv, i + skv - sq + 1))


def make_call(case: DsaCase, dtype: torch.dtype, device="cpu"):
    """``(leaves, kwargs)``: the inputs in call order (attention's differentiable) and the
    other arguments (``names``: the leaves' names)."""
    s, (lead_q, lead_k) = case.seed, _tokens(case)
    q_lengths, kv_lengths = _length_args(case)
    kwargs = {
        "layout": case.param("layout"),
        "top_k": case.param("top_k"),
        "mode": case.param("mode"),
        "segments": segments(case),
        "q_lengths": q_lengths,
        "kv_lengths": kv_lengths,
    }
    if case.operator == "lightning_indexer":
        n, d = case.param("heads"), case.param("dim")
        named = {
            "query": normal((*lead_q, n, d), s) + 1,
            "key": normal((*lead_k, 1, d), s + 1) + 1,
            "weights": normal((*lead_q, n), s + 2),
        }
    else:
        (n1, n2), (d, dv), rope = case.param("heads"), case.param("dims"), case.param("rope")
        named = {
            "query": normal((*lead_q, n1, d), s),
            "key": normal((*lead_k, n2, d), s + 1),
            "value": normal((*lead_k, n2, dv), s + 2),
        }
        if rope:
            named["query_rope"] = normal((*lead_q, n1, rope), s + 3)
            named["key_rope"] = normal((*lead_k, n2, rope), s + 4)
        kwargs["block"] = case.param("block", 1)
        kwargs["scale"] = (d + (rope or 0)) ** -0.5
        kwargs["indices"] = random_indices(case, lead_q, n2, kwargs["block"]).to(device)
    kwargs["names"] = tuple(named)
    grad = case.operator == "sparse_flash_attention"
    leaves = [t.to(dtype).to(device).requires_grad_(grad) for t in named.values()]
    return leaves, kwargs


def random_indices(case: DsaCase, lead_q, kv_heads: int, block: int) -> torch.Tensor:
    """int32 ``[*lead_q, N2, top_k]``: per query and KV head, ``min(top_k, visible blocks)``
    distinct random blocks among those holding a visible key, then -1 (padding rows: all -1)."""
    top_k, mode, layout = case.param("top_k"), case.param("mode"), case.param("layout")
    gen = torch.Generator().manual_seed(case.seed + 5)
    indices = torch.full((*lead_q, kv_heads, top_k), -1, dtype=torch.int32)
    for b, q0, sq, _, skv in segments(case):
        rows = _rows(indices, layout, b, q0, sq)
        for i, h in itertools.product(range(sq), range(kv_heads)):
            blocks = -(-_visible(mode, i, sq, skv) // block)
            take = min(top_k, blocks)
            rows[i, h, :take] = torch.randperm(blocks, generator=gen)[:take].to(torch.int32)
    return indices


# -------------------------------------------------------------------------------------- oracles


def indexer_scores(query, key, weights, case: DsaCase) -> list[torch.Tensor]:
    """Per sequence, float64 ``[q_len, kv_len]``: ``sum_h w_h relu(q_h . k)``, -inf on the keys
    the query may not see."""
    layout, mode, out = case.param("layout"), case.param("mode"), []
    for b, q0, sq, k0, skv in segments(case):
        q = _rows(query, layout, b, q0, sq).double()  # [sq, N, D]
        k = _rows(key, layout, b, k0, skv)[:, 0].double()  # [skv, D]
        w = _rows(weights, layout, b, q0, sq).double()  # [sq, N]
        scores = ((q @ k.T).clamp(min=0) * w[:, :, None]).sum(1)  # [sq, skv]
        seen = torch.tensor([_visible(mode, i, sq, skv) for i in range(sq)])
        hidden = torch.arange(skv)[None, :] >= seen[:, None]
        out.append(scores.masked_fill(hidden, float("-inf")))
    return out


def attention_oracle(case: DsaCase, leaves, kwargs) -> tuple[torch.Tensor, None]:
    """Dense masked softmax attention in float64 (differentiable), the keep mask holding only
    each query's selected keys: ``(out, None)``, out in query's layout with value's D; rows
    that keep no key (and BSND padding) are 0."""
    named = dict(zip(kwargs["names"], (t.double() for t in leaves), strict=True))
    q, k, v = named["query"], named["key"], named["value"]
    layout, block = kwargs["layout"], kwargs["block"]
    group = q.shape[-2] // k.shape[-2]
    indices = kwargs["indices"].cpu().long()
    pieces = {}
    for b, q0, sq, k0, skv in kwargs["segments"]:
        qs, ks, vs = (
            _rows(t, layout, b, a, n) for t, a, n in ((q, q0, sq), (k, k0, skv), (v, k0, skv))
        )
        scores = torch.einsum("qnd,knd->nqk", qs, ks.repeat_interleave(group, 1))
        if "query_rope" in named:
            qr = _rows(named["query_rope"], layout, b, q0, sq)
            kr = _rows(named["key_rope"], layout, b, k0, skv).repeat_interleave(group, 1)
            scores = scores + torch.einsum("qnd,knd->nqk", qr, kr)
        keep = _selected(_rows(indices, layout, b, q0, sq), skv, block, kwargs["mode"], sq)
        keep = keep.repeat_interleave(group, 0)  # [N1, sq, skv]
        scores = (scores * kwargs["scale"]).masked_fill(~keep, float("-inf"))
        kept = keep.any(-1, keepdim=True)
        shift = torch.where(kept, scores.detach().amax(-1, keepdim=True), 0.0)
        weights = torch.exp(scores - shift)
        probs = weights / torch.where(kept, weights.sum(-1, keepdim=True), 1.0)
        pieces[b, q0] = torch.einsum("nqk,knd->qnd", probs, vs.repeat_interleave(group, 1))
    return _assemble(pieces, q, v, layout), None


def _selected(indices, skv, block, mode, sq) -> torch.Tensor:
    """bool ``[N2, sq, skv]``: the keys each query's indices ``[sq, N2, K]`` select (block
    ``[j * block, (j + 1) * block)`` per index ``j >= 0``) that it may see."""
    keep = torch.zeros(indices.shape[1], sq, skv + 1, dtype=torch.bool)
    for o in range(block):
        pos = indices * block + o
        pos = torch.where((indices >= 0) & (pos < skv), pos, skv)  # skv: a discard column
        keep.scatter_(2, pos.permute(1, 0, 2), True)
    keep = keep[..., :skv]
    seen = torch.tensor([_visible(mode, i, sq, skv) for i in range(sq)], dtype=torch.long)
    return keep & (torch.arange(skv)[None, None, :] < seen[None, :, None])


def _assemble(pieces, q, v, layout) -> torch.Tensor:
    """The sequences' ``[len, N1, Dv]`` outputs in query's layout (BSND padding: zeros)."""
    if layout == "TND":
        return torch.cat([pieces[key] for key in sorted(pieces)])
    rows = []
    for b in range(q.shape[0]):
        part = pieces[b, 0]
        pad = part.new_zeros(q.shape[1] - part.shape[0], *part.shape[1:])
        rows.append(torch.cat([part, pad]))
    return torch.stack(rows) if rows else q.new_zeros(*q.shape[:-1], v.shape[-1])


# ------------------------------------------------------------------------------------- the calls


def call_operator(case: DsaCase, leaves, kwargs, kernel: str = "reference"):
    """Run the operator through ``mcore_npu.ops``: indexer ``(indices, values)`` (with
    ``return_value``), attention ``(out, None)``."""
    from mcore_npu import ops

    named = dict(zip(kwargs["names"], leaves, strict=True))
    layout, mode = kwargs["layout"], kwargs["mode"]
    if case.operator == "lightning_indexer":
        return ops.lightning_indexer(
            named["query"],
            named["key"],
            named["weights"],
            layout_query=layout,
            layout_key=layout,
            actual_seq_lengths_query=kwargs["q_lengths"],
            actual_seq_lengths_key=kwargs["kv_lengths"],
            sparse_count=kwargs["top_k"],
            sparse_mode=mode,
            return_value=True,
            kernel=kernel,
        )
    out = ops.sparse_flash_attention(
        named["query"],
        named["key"],
        named["value"],
        kwargs["indices"].to(leaves[0].device),
        kwargs["scale"],
        query_rope=named.get("query_rope"),
        key_rope=named.get("key_rope"),
        actual_seq_lengths_query=kwargs["q_lengths"],
        actual_seq_lengths_kv=kwargs["kv_lengths"],
        sparse_block_size=kwargs["block"],
        layout_query=layout,
        layout_kv=layout,
        sparse_mode=mode,
        kernel=kernel,
    )[0]
    return out, None


def compare_selection(case: DsaCase, got, want_values, scores, slack: float) -> CaseResult:
    """The indexer's ``got = (indices, values)`` per query: ``indices`` counts the queries whose
    selection is wrong (see the table's header; ``slack``: how far below the oracle's
    ``take``-th best score a selected key may score, 0 = only exact ties); ``forward`` compares
    the values of the ``take`` selected keys, best first, with ``want_values`` (same layout)."""
    layout, top_k = case.param("layout"), case.param("top_k")
    got_idx, got_val = (t.detach().cpu() for t in got)
    wrong, problems, got_kept, want_kept = 0, [], [], []
    for (b, q0, sq, _, skv), seq_scores in zip(segments(case), scores):
        idx, val = _rows(got_idx, layout, b, q0, sq)[:, 0], _rows(got_val, layout, b, q0, sq)[:, 0]
        want = _rows(want_values.cpu(), layout, b, q0, sq)[:, 0]
        for i in range(sq):
            take = min(top_k, int(torch.isfinite(seq_scores[i]).sum()))
            row = idx[i].long()
            outside = row[(row >= skv) | (row < -1)]
            if outside.numel():
                problems.append(
                    f"query {q0 + i} (sequence of {skv} keys) selects {outside.tolist()}"
                )
            wrong += not _row_selects_the_best(row, seq_scores[i], take, skv, slack)
            got_kept.append(val[i, :take])
            want_kept.append(want[i, :take])
    total = sum(sq for _, _, sq, _, _ in segments(case))
    comparisons = (
        compare("forward", torch.cat(got_kept), torch.cat(want_kept), None, case.forward),
        Comparison("indices", float(wrong), 0.0, total),
    )
    return CaseResult(case.id, comparisons, tuple(problems[:3]))


def _row_selects_the_best(row, scores, take: int, skv: int, slack: float) -> bool:
    """``row`` (int64 ``[K]``) holds ``take`` distinct visible keys then -1, and none of them
    scores below the ``take``-th best of ``scores`` (``[skv]``, -inf: hidden) less ``slack``."""
    chosen, rest = row[:take], row[take:]
    if bool((rest != -1).any()) or bool(((chosen < 0) | (chosen >= skv)).any()):
        return False
    if chosen.unique().numel() != take:
        return False
    if take == 0:
        return True
    floor = scores.topk(take).values[-1]
    return bool((scores[chosen] >= floor - slack).all())


def _oracle_values(case: DsaCase, scores, like: torch.Tensor) -> torch.Tensor:
    """float64 ``like``-shaped (``[..., 1, K]``): each query's best oracle scores, best first."""
    values = torch.full(like.shape, float("-inf"), dtype=torch.float64)
    layout, top_k = case.param("layout"), case.param("top_k")
    for (b, q0, sq, _, skv), seq_scores in zip(segments(case), scores):
        take = min(top_k, skv)
        if take:
            _rows(values, layout, b, q0, sq)[:, 0, :take] = seq_scores.topk(take, -1).values
    return values


# ------------------------------------------------------------------------------------ the checks


def check_reference_dsa_case(case: DsaCase, device="cpu"):
    """The reference in the case's dtype against the float64 oracle (same rounded inputs)."""
    leaves, kwargs = make_call(case, case.dtype, device)
    got = call_operator(case, leaves, kwargs, "reference")
    exact, cpu_kwargs = make_call(case, case.dtype, "cpu")
    if case.operator == "lightning_indexer":
        scores = indexer_scores(*exact, case)
        return compare_selection(case, got, _oracle_values(case, scores, got[0]), scores, 0.0)
    exact = [t.detach().double().requires_grad_() for t in exact]
    return compare_outputs(case, got, leaves, attention_oracle(case, exact, cpu_kwargs), exact)


def check_kernel_dsa_case(case: DsaCase, device):
    """The kernel ``auto`` picks on ``device`` against the float32 reference on the CPU; the
    indexer's selections against the float64 scores, up to ties within the forward bound."""
    leaves, kwargs = make_call(case, case.dtype, device)
    got = call_operator(case, leaves, kwargs, "auto")
    rounded, cpu_kwargs = make_call(case, case.dtype, "cpu")
    wide = [t.detach().float().requires_grad_(t.requires_grad) for t in rounded]
    want = call_operator(case, wide, cpu_kwargs, "reference")
    if case.operator == "lightning_indexer":
        scores = indexer_scores(*rounded, case)
        finite = torch.cat([s[torch.isfinite(s)] for s in scores])
        slack = case.forward.bound(finite.abs().max().item() if finite.numel() else 0.0)
        return compare_selection(case, got, want[1], scores, slack)
    return compare_outputs(case, got, leaves, want, wide)
