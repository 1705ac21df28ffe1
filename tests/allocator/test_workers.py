"""Tests for ``mcore_npu.allocator.workers.ExpandableSegmentsMixin``.

No hardware is used: a fake ``torch.npu`` (``tests/allocator_standins.py``, installed with
``monkeypatch``) records every call to the allocator setter, so the tests can see when the mixin
calls it relative to the base class's ``__init__``.
"""

from __future__ import annotations

import os

import pytest

from mcore_npu.allocator.workers import ExpandableSegmentsMixin
from tests.allocator.standins import (
    FakeNpu,
    clean_allocator_state,  # noqa: F401  (a fixture, used through pytestmark)
    install_cpu_only,
    install_fake_npu,
)

ON = "expandable_segments:True"
OFF = "expandable_segments:False"


pytestmark = pytest.mark.usefixtures("clean_allocator_state")


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> FakeNpu:
    return install_fake_npu(monkeypatch)


class RecordingBase:
    """A worker base that records what the allocator had seen when its body started."""

    fake: FakeNpu

    def __init__(self, *args, **kwargs):
        self.calls_when_base_started = list(self.fake.calls)
        self.base_args = args
        self.base_kwargs = kwargs


def _worker_class(fake: FakeNpu, **attributes):
    base = type("Base", (RecordingBase,), {"fake": fake})
    return type("Worker", (ExpandableSegmentsMixin, base), attributes)


def test_setter_runs_once_before_base_init(npu):
    worker = _worker_class(npu)()
    assert worker.calls_when_base_started == [ON]
    assert npu.calls == [ON]
    assert worker.expandable_segments_enabled is True
    assert worker.expandable_segments_applied is True


def test_keyword_false_is_honoured_and_removed(npu):
    worker = _worker_class(npu)(expandable_segments=False)
    assert npu.calls == [OFF]
    assert worker.calls_when_base_started == [OFF]
    assert "expandable_segments" not in worker.base_kwargs
    assert worker.expandable_segments_enabled is False  # off, as asked
    assert worker.expandable_segments_applied is True  # and the request took effect


def test_other_arguments_arrive_unchanged(npu):
    config = {"lr": 1e-4}
    worker = _worker_class(npu)(
        config, 3, role="actor", expandable_segments=True, expandable_segments_strict=False
    )
    assert worker.base_args == (config, 3)
    assert worker.base_args[0] is config
    assert worker.base_kwargs == {"role": "actor"}


def test_class_attribute_default(npu):
    worker = _worker_class(npu, expandable_segments=False)()
    assert npu.calls == [OFF]
    assert worker.expandable_segments_enabled is False  # segments are off
    assert worker.expandable_segments_applied is True  # because False is in effect
    worker = _worker_class(npu, expandable_segments=False)(expandable_segments=True)
    assert npu.calls == [OFF, ON]


def test_strict_from_class_attribute_and_keyword(monkeypatch):
    fake = install_fake_npu(monkeypatch, has_setter=False, initialized=True)
    with pytest.raises(RuntimeError, match="torch-npu"):
        _worker_class(fake, expandable_segments_strict=True)()
    with pytest.raises(RuntimeError, match="torch-npu"):
        _worker_class(fake)(expandable_segments_strict=True)
    with pytest.warns(UserWarning, match="torch-npu"):
        worker = _worker_class(fake)()
    assert worker.expandable_segments_enabled is False
    assert worker.expandable_segments_applied is False


def test_failed_disable_is_not_reported_as_enabled(monkeypatch):
    fake = install_fake_npu(monkeypatch, setter_error=RuntimeError("driver says no"))
    with pytest.warns(UserWarning):
        worker = _worker_class(fake)(expandable_segments=False)
    assert fake.calls == [OFF]
    assert worker.expandable_segments_applied is False
    assert worker.expandable_segments_enabled is False


def test_diamond_calls_setter_once(npu):
    base = type("Base", (RecordingBase,), {"fake": npu})

    class Left(ExpandableSegmentsMixin, base):
        pass

    class Right(ExpandableSegmentsMixin, base):
        pass

    class Both(Left, Right):
        pass

    worker = Both("x", expandable_segments=True)
    assert npu.calls == [ON]
    assert worker.base_args == ("x",)


def test_explicit_double_init_calls_setter_once(npu):
    base = type("Base", (RecordingBase,), {"fake": npu})

    class Left(ExpandableSegmentsMixin, base):
        pass

    class Other:
        def __init__(self, *args, **kwargs):
            pass

    class Right(ExpandableSegmentsMixin, Other):
        pass

    class Legacy(Left, Right):
        def __init__(self):
            Left.__init__(self)  # old-style explicit calls reach the mixin twice
            Right.__init__(self, expandable_segments=False)

    Legacy()
    assert npu.calls == [ON]


def test_bad_keyword_type_names_argument(npu):
    with pytest.raises(TypeError, match=r"expandable_segments must be a bool, got 'yes'"):
        _worker_class(npu)(expandable_segments="yes")
    assert npu.calls == []


def test_cpu_worker_reports_false(monkeypatch):
    recorder = install_cpu_only(monkeypatch)

    class Worker(ExpandableSegmentsMixin):
        pass

    worker = Worker()
    assert worker.expandable_segments_enabled is False
    assert worker.expandable_segments_applied is False
    assert recorder.all_calls == []


# ---------------------------------------------------------------------------------------------
# the verl regression (verl PR 6346)
# ---------------------------------------------------------------------------------------------


class VerlWorker:
    """Stand-in for ``verl.single_controller.base.Worker``."""

    def __init__(self, cuda_visible_devices=None):
        self.cuda_visible_devices = cuda_visible_devices


class VerlTrainingWorker(VerlWorker):
    """Shaped like verl's ``TrainingWorker`` after PR 6346.

    PR 5795 had ``os.environ["PYTORCH_NPU_ALLOC_CONF"] = "expandable_segments:True"`` here; PR
    6346 deleted it without adding a call to the runtime setter. What is left initialises the
    process group and NUMA affinity only.
    """

    def __init__(self, config):
        VerlWorker.__init__(self)
        self.config = config
        self.process_group = "initialised"  # torch.distributed.init_process_group(...)
        self.numa_affinity = "bound"  # NUMA binding of the worker


class FixedTrainingWorker(ExpandableSegmentsMixin, VerlTrainingWorker):
    """The same worker with the mixin in front."""


def test_verl_training_worker_regression(npu):
    VerlTrainingWorker(config={"model": "tiny"})
    assert npu.calls == []  # the bug: expandable segments are never enabled

    worker = FixedTrainingWorker(config={"model": "tiny"})
    assert npu.calls == [ON]
    assert worker.expandable_segments_enabled is True
    assert worker.config == {"model": "tiny"}
    assert worker.process_group == "initialised"
    assert worker.numa_affinity == "bound"


def test_verl_training_worker_regression_on_old_torch_npu(monkeypatch):
    fake = install_fake_npu(monkeypatch, has_setter=False, initialized=False)
    VerlTrainingWorker(config={})
    assert "PYTORCH_NPU_ALLOC_CONF" not in os.environ

    FixedTrainingWorker(config={})
    assert os.environ["PYTORCH_NPU_ALLOC_CONF"] == ON
    assert fake.calls == []
