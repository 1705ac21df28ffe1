"""Names of one tensor in the two parameter layouts, and a strict matching of two name sets.

The te layout fuses norms into the following linear: ``input_layernorm.*`` <->
``self_attention.linear_qkv.layer_norm_*``, a dense layer's ``pre_mlp_layernorm.*`` <->
``mlp.linear_fc1.layer_norm_*``, MLA's ``q_layernorm`` / ``kv_layernorm`` <-> ``linear_q_up_proj`` /
``linear_kv_up_proj.layer_norm_*``. Everything else is the same, except ``_extra_state`` entries
(empty) that only the te layout has. See docs/specs.md."""

from __future__ import annotations

from collections.abc import Iterable

EXTRA_STATE = "_extra_state"
_RENAMES = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
    ("self_attention.q_layernorm.", "self_attention.linear_q_up_proj.layer_norm_"),  # MLA
    ("self_attention.kv_layernorm.", "self_attention.linear_kv_up_proj.layer_norm_"),  # MLA
)


def other_names(name: str) -> list[str]:
    """The names ``name``'s tensor may have in the other layout (or on disk), best first."""
    found = []
    for local, te in _RENAMES:
        for old, new in ((local, te), (te, local)):
            head, sep, tail = name.rpartition(old)
            if sep and (not head or head.endswith(".")):
                found.append(f"{head}{new}{tail}")
    return found


def match_names(
    source: Iterable[str], target: Iterable[str], *, every_source: bool = True
) -> dict[str, str]:
    """``{target name: source name}`` for every target name, across layouts.

    A target name matches the same source name, else one of ``other_names``; ``_extra_state`` may be
    missing on either side. ``every_source=False`` leaves the source side to the caller (a pipeline
    stage takes only its part of a checkpoint).

    Raises:
        ValueError: naming every unmatched tensor, target side and source side.
    """
    source, target = set(source), list(target)
    matched: dict[str, str] = {}
    for name in target:
        candidates = [name, *other_names(name)]
        hit = next((c for c in candidates if c in source and c not in matched.values()), None)
        if hit is not None:
            matched[name] = hit
    missing = [n for n in target if n not in matched and not n.endswith(EXTRA_STATE)]
    unused = unused_names(source, matched.values()) if every_source else []
    if missing or unused:
        raise mismatch_error(missing, unused)
    return matched


def unused_names(source: Iterable[str], taken: Iterable[str]) -> list[str]:
    """Source tensors (not ``_extra_state``) that no target took, sorted."""
    taken = set(taken)
    return sorted(n for n in source if n not in taken and not n.endswith(EXTRA_STATE))


def mismatch_error(missing: list[str], unused: list[str]) -> ValueError:
    """The error naming unmatched tensors on both sides."""
    return ValueError(
        "checkpoint names do not match the model across parameter layouts:\n"
        f"  model tensors with no checkpoint tensor: {missing or 'none'}\n"
        f"  checkpoint tensors no model tensor takes: {unused or 'none'}\n"
        "  check model.param_layout and the model's shape (layers, experts, norms, qk-norm)"
    )


def rename_state_dict(state_dict: dict, target_names: Iterable[str]) -> dict:
    """``state_dict`` (either layout) under ``target_names``, strict as ``match_names``."""
    matched = match_names(state_dict.keys(), target_names)
    return {target: state_dict[source] for target, source in matched.items()}
