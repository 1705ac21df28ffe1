"""The CPU dry run of verl's own trainers: a verl platform, the CPU rollout, the runtime.

Importing this package changes nothing; the switch is
``VERL_USE_EXTERNAL_MODULES=mcore_npu.integrations.verl.cpu_runtime`` (see that module).

- :mod:`.platform`: ``CpuPlatform``, verl's platform interface on a CPU (gloo, no IPC, Ray
  resource ``NPU``);
- :mod:`.rollout`: the rollout ``hf_cpu`` (adapter in each actor worker, one replica per rollout
  world, one server actor per replica);
- :mod:`.sampler`: autoregressive sampling with ``transformers`` on the synced weights;
- :mod:`.runtime`: ``activate()``, what the switch runs in every process.
"""
