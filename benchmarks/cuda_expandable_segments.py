"""Show on a CUDA machine where new allocations land around ``set_expandable_segments``.

Three phases, each allocating one fresh tensor (after ``empty_cache()``, so nothing is reused):

1. ``enabled``  - after ``set_expandable_segments(True)``: the tensor's segment is expandable.
2. ``disabled`` - inside ``with expandable_segments(False):``: a classic segment.
3. ``restored`` - after the ``with`` block: expandable again.

The segment of a tensor is read from ``torch.cuda.memory_snapshot()``: the entry whose
``[address, address + total_size)`` holds ``tensor.data_ptr()``. Its ``is_expandable`` key comes
from the C++ snapshot code (``torch/csrc/cuda/memory_snapshot.cpp``); the Python docstring of
``torch.cuda.memory._snapshot`` does not list it, so its absence is handled.

Usage::

    python benchmarks/cuda_expandable_segments.py [--mib 64]

Prints a JSON result. Exit status: 0 the expectation holds, 1 it does not, 2 the check cannot
run here (no CUDA device, or a torch whose snapshot has no ``is_expandable`` key).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_FAILED, EXIT_CANNOT_RUN = 0, 1, 2
_KEY = "is_expandable"


def _import_mcore_npu_device() -> Any:
    """``mcore_npu.allocator.device``, from the installed package or from this checkout."""
    try:
        from mcore_npu.allocator import device
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from mcore_npu.allocator import device
    return device


def _segment_of(torch: Any, tensor: Any) -> dict[str, Any] | None:
    """The memory-snapshot segment that holds ``tensor``'s storage, or None."""
    pointer = tensor.data_ptr()
    for segment in torch.cuda.memory_snapshot():
        start = segment["address"]
        if start <= pointer < start + segment["total_size"]:
            return segment
    return None


def _allocate_and_inspect(torch: Any, phase: str, nbytes: int, keep: list[Any]) -> dict[str, Any]:
    """Allocate ``nbytes`` in a fresh segment and describe the segment it landed in."""
    torch.cuda.empty_cache()  # drop free cached blocks so the request needs a new segment
    tensor = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    keep.append(tensor)  # keep it alive so its segment stays reserved
    torch.cuda.synchronize()
    segment = _segment_of(torch, tensor)
    if segment is None:
        return {"phase": phase, "found": False}
    return {
        "phase": phase,
        "found": True,
        "has_key": _KEY in segment,
        "is_expandable": segment.get(_KEY),
        "segment_address": hex(segment["address"]),
        "segment_total_size": segment["total_size"],
    }


def _cannot_run(reason: str) -> int:
    print(json.dumps({"ok": None, "skipped": reason}, indent=2))
    print(f"cuda_expandable_segments: cannot run here: {reason}", file=sys.stderr)
    return EXIT_CANNOT_RUN


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="size of each allocation in MiB")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        return _cannot_run(
            f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
            "run this script on a machine with an NVIDIA GPU"
        )
    device = _import_mcore_npu_device()
    if device.current_accelerator() != "cuda":
        return _cannot_run(f"the accelerator is {device.current_accelerator()!r}, not CUDA")

    nbytes = args.mib * 1024 * 1024
    keep: list[Any] = []
    set_returned = device.set_expandable_segments(True, strict=True)  # before the first alloc
    phases = [_allocate_and_inspect(torch, "enabled", nbytes, keep)]
    with device.expandable_segments(False, strict=True) as context_returned:
        phases.append(_allocate_and_inspect(torch, "disabled", nbytes, keep))
    phases.append(_allocate_and_inspect(torch, "restored", nbytes, keep))

    if not all(phase.get("has_key") for phase in phases if phase["found"]):
        return _cannot_run(
            f"torch {torch.__version__}: memory_snapshot() segments have no {_KEY!r} key"
        )
    expected = {"enabled": True, "disabled": False, "restored": True}
    failures = [
        f"{phase['phase']}: expected is_expandable={expected[phase['phase']]}, "
        f"got {phase.get('is_expandable')} (segment found: {phase['found']})"
        for phase in phases
        if not phase["found"] or phase["is_expandable"] is not expected[phase["phase"]]
    ]
    if not (set_returned and context_returned):
        failures.append(
            f"set_expandable_segments(True) returned {set_returned}, "
            f"expandable_segments(False) yielded {context_returned}; both should be True"
        )
    result = {
        "ok": not failures,
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(),
        "allocation_mib": args.mib,
        "set_expandable_segments_returned": set_returned,
        "context_manager_yielded": context_returned,
        "phases": phases,
        "failures": failures,
    }
    print(json.dumps(result, indent=2))
    return EXIT_OK if not failures else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
