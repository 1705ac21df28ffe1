"""Multimodal RoPE angles (Qwen2-VL's sections, Qwen3-VL's interleaving) in plain PyTorch::

    position_ids  [3, B, S]   integer (t, h, w) position of every token
    inv_freq      [F]         floating, the rotary frequencies (F = rot / 2)
    mrope_section (t, h, w)   how many of the F frequencies each axis drives (sum == F for the
                              sections; the interleaving takes transformers' rule as it is)
    out           [S, B, 1, 2F] float32 angles, the layout ``rotary_mul`` takes for
                  ``rotary_mode`` ("half": cat(freqs, freqs); "interleave": each one twice)

``interleaved=True`` (Qwen3-VL, Qwen3.5): frequency ``i`` follows h where ``i % 3 == 1`` and
``i < 3·h``, w where ``i % 3 == 2`` and ``i < 3·w``, else t. ``interleaved=False`` (Qwen2-VL,
Megatron's ``MultimodalRotaryEmbedding``): the first t frequencies follow t, the next h follow h,
the last w follow w. Each angle is one fp32 product ``position · inv_freq``, as transformers
computes it. No Ascend kernel takes a gradient (``npu_mrope`` is inference only); the angles are
made once per batch and the rotation is ``rotary_mul`` (``npu_rotary_mul``)."""

from __future__ import annotations

import torch

from mcore_npu.ops._checks import fail, is_int
from mcore_npu.ops.rotary import ROTARY_MODES

OP = "mrope_angles"


def validate_mrope_angles(
    position_ids,
    inv_freq,
    mrope_section,
    *,
    interleaved=True,
    rotary_mode="half",
    kernel="reference",
) -> None:
    """Check one call (errors name ``position_ids``, ``inv_freq``, ``mrope_section`` or
    ``rotary_mode``)."""
    shown = (("position_ids", position_ids), ("inv_freq", inv_freq))
    if (
        not isinstance(position_ids, torch.Tensor)
        or position_ids.dim() != 3
        or (position_ids.shape[0] != 3)
    ):
        got = list(position_ids.shape) if isinstance(position_ids, torch.Tensor) else position_ids
        fix = "pass [3, B, S] (t, h, w rows; text tokens repeat one position three times)"
        fail(OP, ValueError, "position_ids", f"got {got}", fix, shown)
    if position_ids.is_floating_point() or position_ids.is_complex():
        fix = "pass integer positions (torch.long, as get_rope_index returns them)"
        fail(OP, TypeError, "position_ids", f"dtype {position_ids.dtype}", fix, shown)
    if (
        not isinstance(inv_freq, torch.Tensor)
        or inv_freq.dim() != 1
        or (not inv_freq.is_floating_point())
    ):
        fix = "pass the 1-D floating frequencies (the rotary embedding's inv_freq)"
        fail(OP, ValueError, "inv_freq", "is not a 1-D floating tensor", fix, shown)
    if rotary_mode not in ROTARY_MODES:
        fix = "pass 'half' (rotate-half) or 'interleave' (rotary_interleaved)"
        fail(OP, ValueError, "rotary_mode", f"unknown mode {rotary_mode!r}", fix, shown)
    axis_of(mrope_section, inv_freq.numel(), interleaved)


def axis_of(mrope_section, frequencies: int, interleaved: bool) -> list[int]:
    """The axis (0 t, 1 h, 2 w) each of ``frequencies`` follows; ValueError naming
    ``mrope_section`` when it does not describe them."""
    section = list(mrope_section) if isinstance(mrope_section, list | tuple) else None
    if section is None or len(section) != 3 or any(not is_int(n) or n < 0 for n in section):
        raise ValueError(
            f"mrope_angles: mrope_section: got {mrope_section!r}; pass three non-negative ints "
            "(t, h, w frequencies), e.g. the config's rope_parameters['mrope_section']"
        )
    if interleaved:  # as transformers: the rule alone decides, whatever the counts
        axis = [0] * frequencies
        for a in (1, 2):
            for i in range(a, min(3 * section[a], frequencies), 3):
                axis[i] = a
        return axis
    if sum(section) != frequencies:
        raise ValueError(
            f"mrope_angles: mrope_section: {section} sums to {sum(section)}, not to the "
            f"{frequencies} frequencies; the sections must sum to rot / 2 (the rotary dim's half)"
        )
    return [a for a, n in enumerate(section) for _ in range(n)]


def mrope_angles(
    position_ids, inv_freq, mrope_section, *, interleaved=True, rotary_mode="half", kernel="auto"
) -> torch.Tensor:
    """Angles ``[S, B, 1, 2F]`` fp32 of ``position_ids [3, B, S]`` (see the module docstring);
    ``kernel``: ``auto`` or ``reference`` (no Ascend kernel is registered)."""
    from mcore_npu.ops import registry

    registry.resolve(OP, kernel, position_ids.device)
    validate_mrope_angles(
        position_ids, inv_freq, mrope_section, interleaved=interleaved, rotary_mode=rotary_mode
    )
    axis = axis_of(mrope_section, inv_freq.numel(), interleaved)
    rows = torch.tensor(axis, device=position_ids.device)
    chosen = position_ids.index_select(0, rows).float()  # [F, B, S]
    freqs = (chosen * inv_freq.float()[:, None, None]).permute(2, 1, 0)  # [S, B, F]
    if rotary_mode == "half":
        angles = torch.cat((freqs, freqs), dim=-1)
    else:
        angles = freqs.repeat_interleave(2, dim=-1)
    return angles.unsqueeze(2).contiguous()
