"""The CPU dry run of verl's own trainers: a verl platform (:mod:`.platform`), the rollout
``hf_cpu`` (:mod:`.rollout`, :mod:`.sampler`) and ``activate()`` (:mod:`.runtime`).

Importing this package changes nothing; the switch is
``VERL_USE_EXTERNAL_MODULES=mcore_npu.integrations.verl.cpu_runtime``.
"""
