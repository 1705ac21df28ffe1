"""Exact resume of Megatron-Core's ``DistributedOptimizer`` over torch's Adam (no Apex, no TE).

Without Transformer Engine or Apex, megatron-core 0.16.1 builds its distributed optimizer over
``torch.optim.Adam`` / ``AdamW`` (``distrib_optimizer.py:21-36``: ``HAVE_APEX_OR_TE = False``).
That is the situation on an Ascend NPU without MindSpeed, as well as on a CPU. Loading a
checkpoint then goes wrong, whatever the device:

1. **A fresh optimizer cannot describe itself for loading.** A loader first builds the
   optimizer's ``sharded_state_dict(is_loading=True)``, which calls ``state_dict()``; with torch's
   Adam that reads the step counter out of every parameter's state
   (``distrib_optimizer.py:640-642``) and asserts ``len(steps) == 1``: a worker that has not
   taken a step yet has no state at all, so the assertion fails. (TE's and Apex's FusedAdam keep
   the step in the param groups, where an empty state is fine.)
2. **The parameter state is copied in with the wrong step.** ``load_state_dict`` first sets
   every parameter's ``state["step"]`` to the step of the checkpoint's param groups
   (``distrib_optimizer.py:818-824``), then copies the parameter state in key by key, ``step``
   included (``_set_main_param_and_optimizer_states``, ``distrib_optimizer.py:936-940``). The
   checkpoint has no step per parameter: in the ``dp_reshardable`` format (verl's default,
   ``dist_ckpt_optim_fully_reshardable=False``) it is a ``LocalNonpersistentObject``
   (``distrib_optimizer.py:1664-1667``), so the loading optimizer's own step (0 in a fresh
   worker) is copied back over the checkpoint's; in the ``fully_reshardable`` format it is
   absent and the copy raises ``KeyError: 'step'``.
3. **One step tensor for all parameters.** The step set in (2) is a single tensor, which torch's
   ``Optimizer.load_state_dict`` keeps as that one object: every optimizer step then adds 1 to it
   once per parameter.
4. **fp32 parameters, ``dp_reshardable``.** With fp32 model parameters (no separate main copy)
   the per-parameter copy of (2) writes in place into a view of a parameter that requires grad,
   outside ``no_grad`` (``load_parameter_state_from_dp_reshardable``,
   ``distrib_optimizer.py:1772-1804``, calling ``_set_main_param_and_optimizer_states``), and
   autograd refuses it with a ``RuntimeError``. (bf16 / fp16 models, verl's, have fp32 main
   copies that do not require grad and are not hit.)

Together (2) and (3) restart Adam's bias correction and then run it ahead: the first resumed
loss still matches (it is computed before the update); every later one drifts.

:func:`exact_adam_resume` wraps a load so that none of this happens, on the optimizer objects
it is given only (instance attributes, removed when the block ends; Megatron's classes are not
touched): before the load, each such optimizer with an empty state gets the state Megatron's own
``init_state_fn`` allocates (zero moments) plus a zero step per parameter, so ``state_dict()``
works; during it, the per-parameter copy leaves ``step`` alone and runs under ``no_grad``;
after Megatron's ``load_state_dict``, every parameter gets its own step tensor holding the
checkpoint's step. Optimizers over TE/Apex FusedAdam, the CPU-offload ``HybridDeviceOptimizer``
and non-Adam optimizers are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mcore_npu.optimizer.adam import step_tensor

__all__ = ["exact_adam_resume", "torch_adam_distributed_optimizers"]


def torch_adam_distributed_optimizers(optimizer) -> list:
    """The ``DistributedOptimizer`` objects in ``optimizer`` (itself or a ``ChainedOptimizer``'s
    members) that run over torch's Adam / AdamW without Apex or TE: the ones
    :func:`exact_adam_resume` repairs."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    members = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [
        member
        for member in members
        if isinstance(member, distrib_optimizer.DistributedOptimizer)
        and isinstance(member.optimizer, torch.optim.Adam | torch.optim.AdamW)
    ]


def _allocate_fresh_state(member) -> None:
    """Zero moments (Megatron's ``init_state_fn``) and a zero step for every parameter that has
    no state yet: what torch's Adam would hold before its first step, in the shape its
    ``state_dict`` and Megatron's ``state_dict()`` expect."""
    inner = member.optimizer
    if all(len(inner.state[p]) for group in inner.param_groups for p in group["params"]):
        return
    member.init_state_fn(inner, member.config)
    for group in inner.param_groups:
        for param in group["params"]:
            inner.state[param].setdefault("step", step_tensor(0.0))


def _checkpoint_step(state_dict) -> float:
    """The one step of the checkpoint's param groups (Megatron's ``state_dict()`` writes it)."""
    steps = {group["step"] for group in state_dict["optimizer"]["param_groups"] if "step" in group}
    if len(steps) != 1:
        raise ValueError(
            f"optimizer checkpoint: expected one Adam step in its param groups, found {steps!r}; "
            "was it written by Megatron's DistributedOptimizer over torch's Adam?"
        )
    return float(steps.pop())


def _restoring_step(member):
    """``member.load_state_dict`` that then gives every parameter its own checkpoint step."""
    load = member.load_state_dict

    def load_state_dict(state_dict):
        step = _checkpoint_step(state_dict)
        load(state_dict)
        inner = member.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if inner.state[param]:
                    inner.state[param]["step"] = step_tensor(step)

    return load_state_dict


def _copying_all_but_step(member):
    """``member._set_main_param_and_optimizer_states`` with the live ``step`` kept out of the
    per-parameter copy (the checkpoint holds no step per parameter; :func:`_restoring_step`
    sets it from the param groups), and the copy made under ``torch.no_grad()``: with fp32
    model parameters the main parameter is a view of the model parameter, which requires grad,
    and megatron-core 0.16.1's ``load_parameter_state_from_dp_reshardable`` (unlike its
    ``fully_reshardable`` loader) is not a ``no_grad`` function, so its in-place ``copy_``
    raises "a view of a leaf Variable that requires grad is being used in an in-place
    operation"."""
    copy_states = member._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group_index, group_order = member.model_param_group_index_map[model_param]
        main_param = member.optimizer.param_groups[group_index]["params"][group_order]
        state = member.optimizer.state[main_param]
        step = state.pop("step", None)
        try:
            with torch.no_grad():
                copy_states(model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    return set_states


_WRAPPED = ("load_state_dict", "_set_main_param_and_optimizer_states")


@contextlib.contextmanager
def exact_adam_resume(optimizer) -> Iterator[list]:
    """Load a checkpoint into ``optimizer`` inside this block and its Adam state resumes exactly.

    Yields the optimizers it repairs (empty without torch-Adam distributed optimizers: then it
    changes nothing). The ``load_state_dict`` wrapper is an attribute of each repaired optimizer
    object for the duration of the block only.
    """
    members = torch_adam_distributed_optimizers(optimizer)
    for member in members:
        _allocate_fresh_state(member)
        member.load_state_dict = _restoring_step(member)
        member._set_main_param_and_optimizer_states = _copying_all_but_step(member)
    try:
        yield members
    finally:
        for member in members:
            for name in _WRAPPED:
                vars(member).pop(name, None)
