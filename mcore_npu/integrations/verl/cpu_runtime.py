"""The switch of the CPU dry run of verl's own trainers (``python -m verl.trainer.main_ppo``).

``VERL_USE_EXTERNAL_MODULES=mcore_npu.integrations.verl.cpu_runtime`` makes verl import this
module in every process, which turns that process into a CPU dry-run process
(:func:`mcore_npu.integrations.verl.cpu.runtime.activate`). Nothing else turns it on. Then set
``actor_rollout_ref.rollout.name=hf_cpu`` and the machine sizes: docs/verl_main_ppo.md.
"""

from mcore_npu.integrations.verl.cpu.runtime import activate

activate()
