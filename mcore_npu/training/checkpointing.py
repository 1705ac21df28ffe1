"""Sharded checkpoints through ``megatron.core.dist_checkpointing``.

A checkpoint is a directory ``<checkpoint_dir>/step_<N>`` holding the model and optimizer as
sharded tensors (so a checkpoint saved at one tensor/pipeline-parallel size loads at another)
plus common state (step, scheduler, config). ``<checkpoint_dir>/latest`` names the newest
complete one; it is written only after every rank finished saving.

A checkpoint loads into either parameter layout (``model.param_layout`` te or local) whatever
layout saved it: ``match_layout`` renames the model's sharded keys to the checkpoint's names for
the same tensors (``mcore_npu.transformer.param_layout``) before loading, so ``train.resume`` and
``train.init_from`` cross layouts. Every checkpoint tensor must find a model tensor and the other
way round; an unmatched name is an error that names it. Only ``_extra_state`` entries (TE's FP8
metadata, empty here) may be missing on either side.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

LATEST = "latest"


def step_dir(checkpoint_dir: str | Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"step_{step:07d}"


def latest(checkpoint_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under ``checkpoint_dir``, or None."""
    marker = Path(checkpoint_dir) / LATEST
    if not marker.is_file():
        return None
    path = Path(checkpoint_dir) / marker.read_text().strip()
    return path if path.is_dir() else None


def save(state: dict, checkpoint_dir: str | Path, step: int) -> Path:
    """Save ``state`` (sharded tensors + plain objects) as ``step_<step>`` and mark it latest."""
    from megatron.core import dist_checkpointing

    target = step_dir(checkpoint_dir, step)
    if dist.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, str(target))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(checkpoint_dir) / LATEST).write_text(target.name + "\n")
    dist.barrier()
    return target


OPTIMIZER_PREFIX = "optimizer."  # keys of the optimizer's sharded state on disk


def match_layout(model_state: dict, path: str | Path) -> dict:
    """``model_state`` (a model's ``sharded_state_dict()``) renamed to the names on disk.

    Each value's ``key`` becomes the checkpoint's name for the same tensor (either layout); values
    whose name the checkpoint lacks are dropped (only ``_extra_state`` entries may be). Build the
    optimizer's template from the result, so that its keys follow. Changes the values in place.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: a model tensor without a checkpoint tensor or the reverse, each named.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from mcore_npu.transformer.param_layout import match_names, mismatch_error, unused_names

    if not Path(path).is_dir():
        raise FileNotFoundError(f"checkpoint {path} not found")
    on_disk = load_sharded_metadata(str(path))
    names = {value.key for value in on_disk.values()}  # objects are listed once per shard
    source = [name for name in names if not name.startswith(OPTIMIZER_PREFIX)]
    target = {value.key for value in nested_values(model_state)}
    try:
        matched = match_names(source, sorted(target), every_source=False)
        unused = unused_names(source, _taken_by_any_rank(set(matched.values())))
        if unused:
            raise mismatch_error([], unused)
    except ValueError as err:
        raise ValueError(f"checkpoint {path}: {err}") from None
    kept = {}
    for name, value in model_state.items():
        if value.key in matched:
            value.key = matched[value.key]
            kept[name] = value
    return kept


def _taken_by_any_rank(taken: set[str]) -> set[str]:
    """The union over all ranks: each pipeline stage / expert rank takes its part."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return taken
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, taken)
    return set().union(*gathered)


def load(template: dict, path: str | Path) -> dict:
    """Load ``path`` into the shapes of ``template`` (this process's sharded state dict)."""
    from megatron.core import dist_checkpointing

    if not Path(path).is_dir():
        raise FileNotFoundError(f"checkpoint {path} not found")
    return dist_checkpointing.load(template, str(path))
