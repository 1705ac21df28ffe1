"""The MoE token permute operators' part of the fused case table, with its float64 oracle.

``fused_cases`` hands cases of :data:`OPERATORS` here. Leaves: ``[tokens]`` or ``[tokens,
probs]`` (grad0, grad1), drawn in float64 from the case's seed and cast. Unpermute cases are
round trips (permute, then unpermute with the same kernel's pair): ``sorted_indices`` is each
kernel's own handle. The oracle uses explicit loops (no code shared with ``mcore_npu.ops``);
routing maps are [T, E] bool, True = token routed to expert.
"""

from __future__ import annotations

import torch

PERMUTE = "npu_moe_token_permute_with_routing_map"
UNPERMUTE = "npu_moe_token_unpermute_with_routing_map"
LEGACY_UNPERMUTE = "npu_moe_token_unpermute"
OPERATORS = (PERMUTE, UNPERMUTE, LEGACY_UNPERMUTE)


def _generator(seed):
    return torch.Generator().manual_seed(seed)


def routing(case):
    """``(routing_map [T, E] bool, indices [T, K] int64 or None)`` from the case's seed."""
    t, e = case.param("tokens"), case.param("experts")
    scores = torch.rand(t, e, generator=_generator(case.seed + 7), dtype=torch.float64)
    if case.param("capacity") is not None:  # every expert takes `capacity` tokens
        top = scores.topk(case.param("capacity"), dim=0).indices  # [C, E]
        return torch.zeros(t, e, dtype=torch.bool).scatter(0, top, True), None
    if case.param("density") is not None:  # uneven: tokens routed to 0..E experts
        return scores < case.param("density"), None
    indices = scores.topk(case.param("topk"), dim=1).indices  # [T, K]
    return torch.zeros(t, e, dtype=torch.bool).scatter(1, indices, True), indices


def make_call(case, dtype, device="cpu"):
    """``(leaves, kwargs)``: tokens [T, H] (and probs [T, E] or [T, K]) as leaves."""
    t, h = case.param("tokens"), case.param("hidden")
    tokens = torch.randn(t, h, generator=_generator(case.seed), dtype=torch.float64)
    routing_map, indices = routing(case)
    leaves, kwargs = [tokens], {"routing_map": routing_map.to(device)}
    if case.param("probs"):
        width = indices.shape[1] if case.operator == LEGACY_UNPERMUTE else routing_map.shape[1]
        gen = _generator(case.seed + 1)
        leaves.append(torch.rand(t, width, generator=gen, dtype=torch.float64))
    if indices is not None:
        kwargs["indices"] = indices.to(device)
    if case.param("capacity") is not None:
        kwargs["drop_and_pad"] = True
        kwargs["num_out_tokens"] = case.param("capacity") * case.param("experts")
    if case.param("num_out_tokens") is not None:
        kwargs["num_out_tokens"] = case.param("num_out_tokens")
    leaves = [x.to(dtype).to(device).requires_grad_(True) for x in leaves]
    return leaves, kwargs


def _partner(op, name):
    """The same source's other operator (the reference's or the installed torch_npu's)."""
    from mcore_npu.ops import reference, registry

    if op is getattr(reference, op.__name__, None):
        return getattr(reference, name)
    return registry.by_attribute(name)


def call_operator(case, op, leaves, kwargs):
    """Run the case on ``op`` (torch_npu-shaped); one output tensor."""
    tokens, probs = leaves[0], (leaves[1] if len(leaves) > 1 else None)
    routing_map = kwargs["routing_map"]
    pad = {"drop_and_pad": kwargs.get("drop_and_pad", False)}
    pad["num_out_tokens"] = kwargs.get("num_out_tokens")
    if case.operator == PERMUTE:
        rows, row_probs, _ = op(tokens, routing_map, probs=probs, **pad)
        return torch.cat([rows.reshape(-1), row_probs]) if probs is not None else rows
    if case.operator == UNPERMUTE:
        rows, _, indices = _partner(op, PERMUTE)(tokens, routing_map, **pad)
        kw = {"probs": probs, "routing_map": routing_map, "drop_and_pad": pad["drop_and_pad"]}
        return op(rows, indices, tokens.shape, **kw)
    legacy_permute = _partner(op, "npu_moe_token_permute")
    rows, indices = legacy_permute(tokens, kwargs["indices"], kwargs.get("num_out_tokens"))
    return op(rows, indices, probs)


def _pairs(case, routing_map, indices):
    """The permuted rows' (token, expert-or-choice) pairs, in the contract's order."""
    t, e = routing_map.shape
    if case.operator == LEGACY_UNPERMUTE:  # (token, k) sorted by expert id, ties by position
        k = indices.shape[1]
        flat = sorted(range(t * k), key=lambda i: (int(indices[i // k, i % k]), i))
        return [(i // k, i % k) for i in flat[: case.param("num_out_tokens") or t * k]]
    pairs = []
    for expert in range(e):
        routed = [(tok, expert) for tok in range(t) if routing_map[tok, expert]]
        if case.param("capacity") is not None:  # routed first, then padding tokens
            padding = [(tok, expert) for tok in range(t) if not routing_map[tok, expert]]
            routed = (routed + padding)[: case.param("capacity")]
        pairs += routed
    return pairs


def oracle(case, leaves):
    """The float64 answer from the contract (explicit loops; differentiable)."""
    routing_map, indices = routing(case)
    tokens, probs = leaves[0], (leaves[1] if len(leaves) > 1 else None)
    pairs = _pairs(case, routing_map, indices)
    rows = torch.stack([tokens[tok] for tok, _ in pairs])
    if case.operator == PERMUTE:
        if probs is None:
            return rows
        return torch.cat([rows.reshape(-1), torch.stack([probs[tok, j] for tok, j in pairs])])
    out = [torch.zeros_like(tokens[0]) for _ in range(tokens.shape[0])]
    for row, (tok, j) in zip(rows, pairs):
        out[tok] = out[tok] + (row * probs[tok, j] if probs is not None else row)
    return torch.stack(out)
