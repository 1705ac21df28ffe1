"""Exact resume of Megatron-Core's ``DistributedOptimizer`` over torch's Adam (no Apex, no TE).

Without TE or Apex (an NPU without MindSpeed, a CPU) Megatron's load of such an optimizer fails
on a fresh worker (empty Adam state), restores the wrong step (one shared step tensor, 0 or a
``KeyError``) and, for fp32 models in ``dp_reshardable``, copies in place into a view that
requires grad; docs/verl.md#resume-without-te-or-apex has the details. :func:`exact_adam_resume`
repairs the optimizer objects it is given, for the duration of a load only (instance attributes;
Megatron's classes are not touched). TE/Apex FusedAdam, the CPU-offload optimizer and non-Adam
optimizers are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mcore_npu.optimizer.adam import step_tensor

__all__ = ["exact_adam_resume", "torch_adam_distributed_optimizers"]


def torch_adam_distributed_optimizers(optimizer) -> list:
    """The ``DistributedOptimizer`` objects in ``optimizer`` (or its ``chained_optimizers``) over
    torch's Adam / AdamW without Apex or TE: those :func:`exact_adam_resume` repairs."""
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
    """Zero moments (Megatron's ``init_state_fn``) and a zero step for every parameter without
    state: what torch's Adam holds before its first step."""
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
    per-parameter copy (:func:`_restoring_step` sets it), and the copy under ``no_grad``: an
    fp32 model's main parameter is a view of a parameter that requires grad."""
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
    """Load a checkpoint into ``optimizer`` inside this block and its Adam state resumes exactly;
    yields the optimizers it repairs (none without torch-Adam distributed optimizers)."""
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
