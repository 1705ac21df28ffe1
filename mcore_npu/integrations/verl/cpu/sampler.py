"""Autoregressive sampling on the CPU with a ``transformers`` causal LM (the ``hf_cpu`` server's
engine): one sequence at a time, the model's own KV cache, no batching.

``temperature == 0`` is greedy (log-probs of the raw logits). Otherwise ``top_k`` (``<= 0``: off)
and ``top_p`` (``>= 1``: off) filter the temperature-scaled logits, and the log-prob returned is
``log_softmax(logits / T)`` **before** the filters: what verl's actor recomputes and
``training/rollout_probs_diff_*`` compares. A response stops at an end-of-sequence id (unless
``ignore_eos``) or after ``max_tokens``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """verl's sampling parameters for one request."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 1
    ignore_eos: bool = False

    @classmethod
    def from_request(cls, params: dict, max_tokens: int) -> Sampling:
        """From the dict verl's agent loop sends (``temperature``, ``top_p``, ``top_k``, ...);
        an explicit ``max_tokens`` / ``max_new_tokens`` in it wins over ``max_tokens``."""
        limit = params.get("max_tokens", params.get("max_new_tokens", max_tokens))
        return cls(
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1) or -1),
            max_tokens=max(1, int(limit)),
            ignore_eos=bool(params.get("ignore_eos", False)),
        )


def request_seed(seed: int, *parts) -> int:
    """A 63-bit seed from ``seed`` and ``parts`` (stable across processes, unlike ``hash``)."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``[V]`` logits with the candidates outside top-k / top-p set to ``-inf``."""
    filtered = scaled.clone()
    if 0 < top_k < filtered.numel():
        kth = torch.topk(filtered, top_k).values[-1]
        filtered[filtered < kth] = float("-inf")
    if top_p < 1.0:
        ordered, order = torch.sort(filtered, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) > top_p  # keeps at least the first
        filtered[order[drop]] = float("-inf")
    return filtered


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> tuple[int, float]:
    """One token from ``[V]`` fp32 logits: ``(token id, its log-prob)`` (see the module doc)."""
    if sampling.temperature <= 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    scaled = logits / sampling.temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(filter_logits(scaled, sampling.top_k, sampling.top_p), dim=-1)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(log_probs[token])


@torch.no_grad()
def sample(
    model, prompt_ids: list[int], sampling: Sampling, eos_ids: set[int], generator: torch.Generator
) -> tuple[list[int], list[float], str]:
    """``(token ids, log-probs, "completed")`` of one response to ``prompt_ids`` (``[P]``)."""
    output = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    log_probs: list[float] = []
    for _ in range(sampling.max_tokens):
        token, log_prob = pick(output.logits[0, -1].float(), sampling, generator)
        tokens.append(token)
        log_probs.append(log_prob)
        if (token in eos_ids and not sampling.ignore_eos) or len(tokens) == sampling.max_tokens:
            break  # the last token is never fed back (as vLLM)
        past = output.past_key_values
        output = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
    return tokens, log_probs, "completed"
