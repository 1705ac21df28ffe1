"""Sharded checkpoints through ``megatron.core.dist_checkpointing``.

A checkpoint is a directory ``<checkpoint_dir>/step_<N>`` holding the model and optimizer as
sharded tensors (so a checkpoint saved at one tensor/pipeline-parallel size loads at another)
plus common state (step, scheduler, config). ``<checkpoint_dir>/latest`` names the newest
complete one; it is written only after every rank finished saving.
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


def load(template: dict, path: str | Path) -> dict:
    """Load ``path`` into the shapes of ``template`` (this process's sharded state dict)."""
    from megatron.core import dist_checkpointing

    if not Path(path).is_dir():
        raise FileNotFoundError(f"checkpoint {path} not found")
    return dist_checkpointing.load(template, str(path))
