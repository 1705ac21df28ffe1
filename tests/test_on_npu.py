"""On an Ascend NPU only (skipped elsewhere by the ``npu`` marker, see tests/conftest.py).

The case table through the real ``torch_npu.npu_fusion_attention`` against the reference
(fully masked rows excluded, as the contract says), and a tiny GPT with the NPU spec whose
every layer reached the real kernel, trained by the demo trainer on its NPU table.
"""

from __future__ import annotations

import pytest
import torch

from mcore_npu.tools.cases import load_cases
from mcore_npu.tools.verify import check_kernel_case

pytestmark = pytest.mark.npu


def test_npu_kernel_matches_reference_on_the_case_table():
    results = [check_kernel_case(case, torch.device("npu", 0)) for case in load_cases()]
    failed = [r for r in results if not r.passed]
    assert not failed, "\n".join(map(str, failed[:20]))


def test_npu_spec_model_runs_on_the_kernel():
    """The demo trainer on the NPU table of Megatron's CUDA calls, never transfer_to_npu."""
    import sys

    from mcore_npu.training import npu_calls, runtime
    from mcore_npu.training.config import load_config
    from mcore_npu.training.train import Trainer

    cfg = load_config(None, ["train.steps=2", "attention.backend=npu_fusion",
                             "attention.kernel=torch_npu", "train.metrics_file=null"])  # fmt: skip
    try:
        summary = Trainer(cfg).train()
    finally:
        runtime.shutdown()
    assert summary.kernel == "torch_npu" and summary.final_loss is not None
    assert npu_calls.applied() and "torch_npu.contrib.transfer_to_npu" not in sys.modules
