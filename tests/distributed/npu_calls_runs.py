"""Test-only entry point: ``tests.distributed.layout_runs`` on the demo trainer's NPU table
(``mcore_npu.training.npu_calls``) instead of the CPU runtime, over a CPU-backed stand-in
``torch.npu`` (tests/npu_module_standin.py; no NPU here), on the CPU's devices and gloo.

    torchrun --standalone --nproc-per-node N -m tests.distributed.npu_calls_runs CONFIG RUNS_JSON

Rank 0 prints ``npu_calls_runs: torch.npu calls: {...}`` (the stand-in's counts) and whether
``transfer_to_npu`` was loaded, after the runs.
"""

from __future__ import annotations

import json
import sys

from mcore_npu.training import runtime
from tests import npu_module_standin
from tests.distributed import layout_runs


def main(argv: list[str]) -> int:
    npu = npu_module_standin.install()
    prepare = runtime._prepare_accelerator
    runtime._prepare_accelerator = lambda accelerator: prepare("npu")  # what an NPU would take
    code = layout_runs.main(argv)
    if code == 0 and runtime.LaunchEnv.from_environ().rank == 0:
        loaded = "torch_npu.contrib.transfer_to_npu" in sys.modules
        print(f"npu_calls_runs: torch.npu calls: {json.dumps(dict(npu.calls))}", flush=True)
        print(f"npu_calls_runs: transfer_to_npu loaded: {loaded}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
