"""The expandable-segments regression, shown against the real verl 0.9.1 workers.

verl's ``TrainingWorker.__init__`` never calls the allocator setter (PR 6346 deleted the
``PYTORCH_NPU_ALLOC_CONF`` lines and added no call). The plugin's worker calls it once, before
verl's ``__init__`` body runs. Stand-in: only the NPU allocator (``tests/allocator/standins.py``,
a fake ``torch.npu`` that records every setter call); verl, Megatron and gloo are real.
"""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

pytest.importorskip("verl")

from omegaconf import OmegaConf
from verl.utils.device import set_expandable_segments
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from mcore_npu.allocator.workers import ExpandableSegmentsMixin
from mcore_npu.integrations.verl.engine import NPUMegatronEngineWithLMHead
from mcore_npu.integrations.verl.workers import (
    NPUActorRolloutRefWorker,
    NPUTrainingWorker,
)
from tests.allocator.standins import (
    clean_allocator_state,  # noqa: F401  (a fixture, used through pytestmark)
    install_fake_npu,
)
from tests.integrations.conftest import training_worker_config
from tests.launch import run_command

ON = "expandable_segments:True"

pytestmark = pytest.mark.usefixtures("clean_allocator_state", "cpu_runtime", "npu_engine_env")


class SetterWitness:
    """Wraps the stand-in setter: records each call and which verl ``__init__`` was running."""

    def __init__(self, fake, *verl_inits) -> None:
        self.fake, self.setter = fake, fake.memory._set_allocator_settings
        self.codes = {init.__code__: init.__qualname__ for init in verl_inits}
        self.running: list[list[str]] = []  # per call: the verl __init__ frames on the stack
        fake.memory._set_allocator_settings = self

    def __call__(self, settings: str) -> None:
        frame, inside = sys._getframe(1), []
        while frame is not None:
            if frame.f_code in self.codes:
                inside.append(self.codes[frame.f_code])
            frame = frame.f_back
        self.running.append(inside)
        self.setter(settings)


def _record_verl_platform_setter(monkeypatch) -> list[str]:
    """Record verl's own route too: on this CPU host verl's platform is its CUDA fallback,
    whose ``set_allocator_settings`` calls ``torch.cuda.memory._set_allocator_settings``."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    return calls


def test_verl_training_worker_never_sets_the_allocator(monkeypatch, tiny_hf_model):
    fake = install_fake_npu(monkeypatch)
    verl_route = _record_verl_platform_setter(monkeypatch)
    worker = TrainingWorker(training_worker_config(tiny_hf_model))
    assert fake.calls == [] and verl_route == []  # the regression: nothing at construction
    assert worker.engine is not None  # construction went all the way through

    set_expandable_segments(True)  # control: a call through verl's own helper is seen
    assert fake.calls + verl_route == [ON]


def test_plugin_worker_sets_them_once_before_verl_init_body(monkeypatch, tiny_hf_model):
    fake = install_fake_npu(monkeypatch)
    witness = SetterWitness(fake, TrainingWorker.__init__)
    worker = NPUTrainingWorker(training_worker_config(tiny_hf_model))
    assert fake.calls == [ON]
    assert witness.running == [[]]  # TrainingWorker.__init__ had not started
    assert worker.expandable_segments_enabled is True
    assert worker.expandable_segments_applied is True
    assert type(worker.engine) is NPUMegatronEngineWithLMHead  # the plugin's engine, via verl
    assert NPUTrainingWorker.__mro__[1] is ExpandableSegmentsMixin


def _actor_rollout_ref_config():
    """The few fields ``ActorRolloutRefWorker.__init__`` reads (the rest is read by init_model)."""
    return OmegaConf.create(
        {"actor": {"strategy": "megatron", "megatron": {"router_replay": {"mode": "disabled"}}}}
    )


def test_actor_rollout_ref_worker_sets_them_at_its_start(monkeypatch):
    fake = install_fake_npu(monkeypatch)
    witness = SetterWitness(fake, ActorRolloutRefWorker.__init__)
    worker = NPUActorRolloutRefWorker(config=_actor_rollout_ref_config(), role="actor")
    assert fake.calls == [ON] and witness.running == [[]]
    assert worker.expandable_segments_enabled is True
    assert worker.role == "actor"  # verl's __init__ body ran with the arguments unchanged

    fake.calls.clear()
    ActorRolloutRefWorker(config=_actor_rollout_ref_config(), role="actor")
    assert fake.calls == []  # verl's own class: nothing until update_weights


def test_actor_rollout_ref_worker_builds_actor_and_ref_from_the_plugin_worker():
    assert NPUActorRolloutRefWorker.actor_worker_cls is NPUTrainingWorker
    assert NPUActorRolloutRefWorker.ref_worker_cls is NPUTrainingWorker
    assert ActorRolloutRefWorker.actor_worker_cls is TrainingWorker  # verl's class untouched
    # verl's init_model instantiates exactly these attributes (not TrainingWorker by name)
    source = inspect.getsource(ActorRolloutRefWorker.init_model)
    assert "self.actor_worker_cls(config=" in source
    assert "self.ref_worker_cls(config=" in source
    assert "TrainingWorker(" not in source


def test_importing_mcore_npu_never_imports_verl():
    probe = (
        "import sys, mcore_npu, mcore_npu.integrations, mcore_npu.integrations.verl\n"
        "print(sorted({'verl', 'ray', 'megatron'} & {m.split('.')[0] for m in sys.modules}))"
    )
    result = run_command([sys.executable, "-c", probe], check=True, timeout=300)
    assert result.stdout.strip() == "[]"  # verl is installed here, and still not imported
