"""Two names of the earlier API, kept for users' code: ``resolve_kernel`` (the attention
operator's kernel for a device) and ``load_torch_npu``; both ask the registry."""

from __future__ import annotations

from mcore_npu._optional import load
from mcore_npu.ops import registry


def resolve_kernel(kernel: str, device) -> str:
    """``"torch_npu"`` or ``"reference"``: the kernel a ``fusion_attention`` call on ``device``
    runs (``registry.resolve("fusion_attention", kernel, device)``)."""
    return registry.resolve("fusion_attention", kernel, device).kernel


def load_torch_npu():
    """``torch_npu``, imported now, or an ImportError that says why and how to fix it."""
    return load("torch_npu")
