"""Old module paths that keep importing, with a ``DeprecationWarning`` naming the new one.

Each old module (``mcore_npu/attention.py``, ...) is two lines: it calls :func:`alias` with its own
name and the new path. The old name then *is* the new module (``sys.modules`` points both names
at one object), so attribute reads, ``isinstance`` checks and monkeypatching see one module.
"""

from __future__ import annotations

import importlib
import sys
import warnings

# old module path -> where it lives now; removed in the release after next
MOVED = {
    "mcore_npu.attention": "mcore_npu.transformer.attention",
    "mcore_npu.layer_specs": "mcore_npu.transformer.layer_specs",
    "mcore_npu.device": "mcore_npu.allocator.device",
    "mcore_npu.workers": "mcore_npu.allocator.workers",
}


def alias(old: str) -> None:
    """Make ``old`` an alias of its new module and warn once (per process) that it moved."""
    new = MOVED[old]
    warnings.warn(
        f"{old} moved to {new}; import {new} (or the name from mcore_npu directly). "
        f"The old path will be removed in a later release.",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
