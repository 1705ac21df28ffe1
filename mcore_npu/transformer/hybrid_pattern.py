"""Megatron's hybrid layer pattern, one symbol per layer: what the installed stack builds.

``M`` Mamba, ``*`` attention, ``-`` MLP, ``E`` MoE (megatron-core 0.16+), ``G`` Gated DeltaNet
(0.17+), ``D`` DeepSeek Sparse Attention (0.18+), ``+`` MLA (0.19). The
pipe ``|`` and the MTP separator ``/`` of 0.17+ patterns are not taken by the trainer (the spec
builds MTP for Megatron's own builder)."""

from __future__ import annotations

import dataclasses

SLOTS = {"M": "mamba_layer", "*": "attention_layer", "-": "mlp_layer", "E": "moe_layer",
         "G": "gdn_layer", "+": "mla_layer", "D": "dsa_layer"}  # fmt: skip
SINCE = {"E": "0.16", "G": "0.17", "D": "0.18", "+": "0.19"}
"""The megatron-core release whose hybrid stack first has the symbol's slot."""


def symbols() -> str:
    """The symbols the installed megatron-core's hybrid stack has a slot for."""
    from mcore_npu.transformer.mamba.stack import StackSubmodules

    names = {field.name for field in dataclasses.fields(StackSubmodules)}
    return "".join(symbol for symbol, slot in SLOTS.items() if slot in names)


def check_pattern(pattern, num_layers: int) -> str:
    """``pattern`` itself, or ValueError naming what is wrong and the fix."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"hybrid_pattern: {pattern!r}; pass a string like 'M*M-', one per layer")
    known = symbols()
    unknown = sorted(set(pattern) - set(known))
    if unknown:
        newer = [f"{symbol!r} came with megatron-core {SINCE[symbol]}" for symbol in unknown
                 if symbol in SINCE]  # fmt: skip
        raise ValueError(
            f"hybrid_pattern: {pattern!r} has {unknown}, which the installed megatron-core's "
            f"hybrid stack with the NPU spec does not build{' (' + ', '.join(newer) + ')' if newer else ''}; "
            f"use the symbols {known!r} (M Mamba, * attention, - MLP, E MoE, G Gated DeltaNet, "
            "+ MLA, D DSA), one per layer"
        )
    if len(pattern) != num_layers:
        raise ValueError(
            f"hybrid_pattern: {pattern!r} has {len(pattern)} layers, model.num_layers is "
            f"{num_layers}; make them agree"
        )
    return pattern
