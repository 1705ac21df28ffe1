"""The switch of the CPU dry run of verl's own trainers (``python -m verl.trainer.main_ppo``).

Export, before the command::

    VERL_USE_EXTERNAL_MODULES=mcore_npu.integrations.verl.cpu_runtime

verl imports the modules named there at the end of ``import verl``, in every process (the driver
and every Ray actor), and importing this module turns that process into a CPU dry-run process:
:func:`mcore_npu.integrations.verl.cpu.runtime.activate`. Nothing else turns it on: importing
``mcore_npu``, its verl plugin or :mod:`mcore_npu.integrations.verl.cpu` does not.

Then set ``actor_rollout_ref.rollout.name=hf_cpu`` (the CPU rollout,
:mod:`mcore_npu.integrations.verl.cpu.rollout`) and the machine sizes; see
``docs/verl_main_ppo.md``.
"""

from mcore_npu.integrations.verl.cpu.runtime import activate

activate()
