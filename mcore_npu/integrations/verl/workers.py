"""verl workers that turn expandable segments on before anything is allocated.

verl 0.9.x's ``TrainingWorker`` never turns them on, and ``ActorRolloutRefWorker`` only after its
first weight sync. These classes put :class:`~mcore_npu.allocator.workers.ExpandableSegmentsMixin`
first among the bases, so the allocator setter runs before verl's ``__init__`` body; pass them
where verl takes worker classes (docs/verl.md). verl still turns expandable segments off around
weight export.
"""

from __future__ import annotations

from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from mcore_npu.allocator.workers import ExpandableSegmentsMixin

__all__ = ["NPUActorRolloutRefWorker", "NPUTrainingWorker"]


class NPUTrainingWorker(ExpandableSegmentsMixin, TrainingWorker):
    """verl's ``TrainingWorker`` with expandable segments set before its ``__init__`` runs.

    ``NPUTrainingWorker(config, *, expandable_segments=True, expandable_segments_strict=False)``;
    afterwards ``expandable_segments_enabled`` / ``expandable_segments_applied`` say whether they
    are on and whether the requested value took effect (both False on CPU).
    """


class NPUActorRolloutRefWorker(ExpandableSegmentsMixin, ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker``, expandable segments on at its own start; its actor and
    reference models are built by :class:`NPUTrainingWorker`."""

    actor_worker_cls = NPUTrainingWorker
    ref_worker_cls = NPUTrainingWorker
