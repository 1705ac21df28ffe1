"""Shared fixtures and markers.

- ``npu`` marker: tests that need a real Ascend NPU; skipped elsewhere with the reason.
- ``cpu_only`` marker: tests of the CPU path (in-process Megatron with the CPU shims, the
  reference kernel's expectations); skipped on a machine with an accelerator, with the reason.
- The order: the modules that launch processes first (see ``_longest_modules_first``).
- ``cpu_runtime``: one process as a one-rank Megatron job (tests/single_rank.py), shared by the
  folders of the other environments.
- ``fake_torch_npu``: a stand-in ``torch_npu`` module in ``sys.modules`` (we have no NPU hardware;
  the stand-in records calls instead of running a kernel).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch


def _npu_present() -> bool:
    """A real NPU: torch_npu imports (from its installed files, not a stand-in) and sees a device."""
    try:
        if importlib.util.find_spec("torch_npu") is None:
            return False
        import torch_npu  # noqa: F401

        return bool(torch.npu.is_available())
    except Exception:  # a stand-in without __spec__, or torch_npu failing without CANN
        return False


def pytest_collection_modifyitems(config, items):
    on_npu = _npu_present()
    skip_npu = pytest.mark.skip(reason="needs an Ascend NPU with torch_npu and CANN; none here")
    skip_cpu_only = pytest.mark.skip(
        reason="checks the CPU path (reference kernel, CPU shims, CPU tensors); this machine has "
        "an accelerator: tests/test_on_npu.py and tests/distributed cover it"
    )
    on_accelerator = on_npu or torch.cuda.is_available()
    for item in items:
        if "npu" in item.keywords and not on_npu:
            item.add_marker(skip_npu)
        if "cpu_only" in item.keywords and on_accelerator:
            item.add_marker(skip_cpu_only)
    items[:] = _longest_modules_first(items)


def _longest_modules_first(items):
    """The modules that launch processes first (``distributed``, then ``slow``), each module's
    tests together and in their order. pytest-xdist (``--dist loadfile``) hands out modules in
    this order, so the long ones start early and the many short ones fill in at the end."""
    weight, first = {}, {}
    for index, item in enumerate(items):
        module = item.nodeid.split("::")[0]
        kind = 0 if "distributed" in item.keywords else 1 if "slow" in item.keywords else 2
        weight[module] = min(weight.get(module, 2), kind)
        first.setdefault(module, index)
    return sorted(items, key=lambda item: (weight[m := item.nodeid.split("::")[0]], first[m]))


class RecordingTorchNpu(types.ModuleType):
    """A stand-in for ``torch_npu`` (no hardware here): records npu_fusion_attention and
    npu_fusion_attention_grad calls and answers with zeros of the right shapes."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls: list[tuple[tuple, dict]] = []
        self.grad_calls: list[tuple[tuple, dict]] = []

    def npu_fusion_attention_grad(self, query, key, value, dy, head_num, input_layout, **kwargs):
        self.grad_calls.append(((query, key, value, dy, head_num, input_layout), kwargs))
        dpse = torch.zeros_like(kwargs["pse"]) if kwargs.get("pse") is not None else None
        extra = query.new_empty(0)  # some releases return more than four values
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value), dpse, extra

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, **kwargs):
        self.calls.append(((query, key, value, head_num, input_layout), kwargs))
        if input_layout in ("BSH", "SBH"):
            out = query.new_zeros(query.shape)
        else:
            out = query.new_zeros(*query.shape[:-1], value.shape[-1])
        return out, None, None, None, 0, 0, 0


@pytest.fixture
def fake_torch_npu(monkeypatch):
    module = RecordingTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return module


@pytest.fixture(autouse=True)
def _fresh_moe_loss_tracker():
    """Megatron keeps the MoE auxiliary losses in a module-global tracker whose per-layer buffer
    is sized by the first model that logs one: a later model with more layers in the same worker
    process would index past it. Empty it after every test (only if Megatron is loaded)."""
    yield
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


@pytest.fixture(autouse=True)
def _fresh_warn_once():
    from mcore_npu._warnings import WARNED

    WARNED.clear()
    yield
    WARNED.clear()


@pytest.fixture(scope="session")
def cpu_runtime():
    """CPU shims + a single-rank gloo group + Megatron parallel state (TP = PP = CP = 1), for the
    tests of the other environments (tests/integrations, tests/nemotron, tests/vision_hf): one
    per process, whichever of those folders a worker runs."""
    from tests.single_rank import single_rank_megatron

    with single_rank_megatron(29561):
        yield


@pytest.fixture(scope="session")
def megatron_runtime():
    """Megatron-Core parallel state for one process (gloo, CPU shims), for in-process tests."""
    from mcore_npu.training import cpu_support, runtime

    state = runtime.initialize(runtime.ParallelLayout(), seed=0)
    yield state
    runtime.shutdown()
    cpu_support.revert()
