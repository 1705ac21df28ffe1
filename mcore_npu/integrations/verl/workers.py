"""verl workers that turn expandable segments on before anything is allocated.

verl 0.9.x calls ``set_expandable_segments`` only in ``ActorRolloutRefWorker.update_weights``
(off around weight export, on afterwards) and in the vLLM server; ``TrainingWorker.__init__``
never calls it (the env-var lines of verl PR 5795 were deleted by PR 6346). So SFT, critic and
disaggregated training workers on NPU run without expandable segments, and colocated actors get
them only after the first weight sync, when model and optimizer memory are already reserved.

The classes below put :class:`~mcore_npu.allocator.workers.ExpandableSegmentsMixin` first among
the bases: the allocator setter runs once per instance, before verl's ``__init__`` body
(process group, NUMA binding, engine, model, optimizer). Pass them where verl takes worker
classes::

    from mcore_npu.integrations.verl.workers import NPUActorRolloutRefWorker, NPUTrainingWorker

    role_worker_mapping = {Role.ActorRollout: ray.remote(NPUActorRolloutRefWorker), ...}
    sft_worker_cls = NPUTrainingWorker          # SFT / critic / disaggregated trainers

verl itself still turns expandable segments off around weight export in ``update_weights`` and
back on afterwards; these classes do not change that.
"""

from __future__ import annotations

from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from mcore_npu.allocator.workers import ExpandableSegmentsMixin

__all__ = ["NPUActorRolloutRefWorker", "NPUTrainingWorker"]


class NPUTrainingWorker(ExpandableSegmentsMixin, TrainingWorker):
    """verl's ``TrainingWorker`` with expandable segments set before its ``__init__`` runs.

    Constructor: ``NPUTrainingWorker(config, *, expandable_segments=True,
    expandable_segments_strict=False)``; ``config`` is verl's ``TrainingWorkerConfig``. After
    construction ``expandable_segments_enabled`` says whether they are on for this process's new
    allocations and ``expandable_segments_applied`` whether the requested value took effect
    (both False on CPU).
    """


class NPUActorRolloutRefWorker(ExpandableSegmentsMixin, ActorRolloutRefWorker):
    """verl's ``ActorRolloutRefWorker``, expandable segments on at its own start.

    Its actor and reference models are built by :class:`NPUTrainingWorker` (``actor_worker_cls``
    / ``ref_worker_cls``), each of which sets them again at its own start (same value; one
    allocator call per worker instance). verl still turns them off around weight export.
    """

    actor_worker_cls = NPUTrainingWorker
    ref_worker_cls = NPUTrainingWorker
