"""verl integration: worker classes, an NPU Megatron engine and the ``verl.plugins`` entry point.

Nothing here is imported by ``import mcore_npu``; import the submodules explicitly (they import
verl, megatron-core and, for the engine, verl's Megatron engine):

- ``mcore_npu.integrations.verl.workers``: ``NPUTrainingWorker`` and ``NPUActorRolloutRefWorker``,
  the classes to pass where verl takes worker classes (expandable segments on at start-up);
- ``mcore_npu.integrations.verl.engine``: ``NPUMegatronEngineWithLMHead`` /
  ``NPUMegatronEngineWithValueHead``, registered for ``backend="megatron", device="npu",
  vendor="huawei"``;
- ``mcore_npu.integrations.verl.plugin``: the ``verl.plugins`` entry point that registers them.
"""
