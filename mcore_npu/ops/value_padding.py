"""A value head dim smaller than the query's (Dv < D, Multi-Latent Attention): padded or not.

The padded path works on every torch_npu: v gets zero columns up to D and the output is sliced
back to Dv (exact; docs/mla.md). The switch ``mla_value_padding`` (:data:`MODES`): ``off`` never
pads, ``on`` always pads, ``auto`` pads when the call runs ``torch_npu`` and
:func:`takes_smaller_value` says the installed operator does not return a Dv-wide output (a
probe, not a version check: one tiny call, cached per torch_npu module and device).
"""

from __future__ import annotations

import weakref

import torch

MODES = ("auto", "on", "off")
PROBE_HEAD_DIM, PROBE_VALUE_DIM = 16, 8

_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # its owner -> {device: bool}


def check_mode(mode: str, name: str = "mla_value_padding") -> str:
    """``mode`` if it is one of :data:`MODES`, else a ValueError naming ``name``."""
    if mode not in MODES:
        raise ValueError(
            f"{name}: unknown value {mode!r}; pass one of {', '.join(MODES)} ('auto' pads v to "
            "the query's head dim only where the installed torch_npu needs it)"
        )
    return mode


def pads(mode: str, kernel: str, device: torch.device) -> bool:
    """Whether a call with Dv < D on ``device`` takes the padded path; ``kernel`` is the
    resolved one (``"torch_npu"`` or ``"reference"``)."""
    check_mode(mode)
    if mode != "auto":
        return mode == "on"
    if kernel != "torch_npu":
        return False  # the reference takes Dv < D in every layout
    from mcore_npu.ops import registry

    return not takes_smaller_value(registry.ascend("fusion_attention"), device)


def takes_smaller_value(op, device: torch.device | str) -> bool:
    """Whether ``op`` (torch_npu's ``npu_fusion_attention``) returns a Dv-wide output for Dv < D:
    one SBH call on ``device`` with one key (the output must be v); any failure reads as "no"."""
    owner = getattr(op, "__self__", None) or op  # a method's (the module's) object is stable
    known = _PROBED.setdefault(owner, {})
    key = str(device)
    if key not in known:
        known[key] = _probe(op, device)
    return known[key]


def _probe(op, device) -> bool:
    dtype = torch.float16  # every release takes fp16 (fp32 is unverified on old ones)
    try:
        q = torch.ones(1, 1, PROBE_HEAD_DIM, dtype=dtype, device=device)
        v = torch.arange(PROBE_VALUE_DIM, dtype=dtype, device=device).view(1, 1, -1)
        with torch.no_grad():
            out = op(q, q, v, 1, "SBH", scale=0.25)[0]
        return tuple(out.shape) == tuple(v.shape) and bool(torch.equal(out.cpu(), v.cpu()))
    except Exception:  # an older operator refuses Dv != D (or the device is unusable)
        return False


def describe(mode: str, kernel: str, device: torch.device) -> str:
    """``"padded"`` or ``"unpadded"``: the path a call with Dv < D takes (for ``doctor``)."""
    return "padded" if pads(mode, kernel, device) else "unpadded"


def pad(value: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[..., n, Dv]`` -> ``[..., n, D]``, zeros in the new columns."""
    return torch.nn.functional.pad(value, (0, head_dim - value.shape[-1]))


def unpad(out: torch.Tensor, heads: int, head_dim_v: int) -> torch.Tensor:
    """``[..., heads * D]`` -> ``[..., heads * Dv]``: each head's first Dv columns."""
    return out.unflatten(-1, (heads, -1))[..., :head_dim_v].flatten(-2)
