"""Sharded checkpoints through ``megatron.core.dist_checkpointing``, saved synchronously.

A checkpoint is a directory ``<checkpoint_dir>/step_<N>`` holding the model and optimizer as
sharded tensors (so a checkpoint saved at one tensor/pipeline-parallel size loads at another)
plus common state (step, scheduler, config)::

    step_0000005/
      common.pt        step, scheduler, config (rank 0, torch.save; megatron-core 0.19+
                       keeps them in the .distcp files instead)
      __0_0.distcp     the tensors written by rank 0 (one file per rank)
      .metadata        where each tensor lies in the .distcp files
      metadata.json    written last, after every rank finished: the folder is complete

``<checkpoint_dir>/latest`` names the newest complete one. It is replaced atomically (written to
a temporary file, fsync'ed, renamed) only after every rank finished saving, so it never names a
half-written folder; resuming does not trust it blindly either (``run_folder.resume_point``).

Saving runs in the training process itself, with no helper process: Megatron's default
``torch_dist`` strategy writes through a forked writer process and a multiprocessing Manager,
which outlive a killed trainer and keep writing. ``sync_save_strategy()`` writes the same format
(Megatron loads it with its own ``torch_dist`` strategy) through PyTorch's plain
``FileSystemWriter`` with one thread, the calling one, and fsyncs every file.

A checkpoint loads into either parameter layout (``model.param_layout`` te or local) whatever
layout saved it: ``match_layout`` renames the model's sharded keys to the checkpoint's names for
the same tensors (``mcore_npu.transformer.param_layout``) before loading, so ``train.resume`` and
``train.init_from`` cross layouts. Every checkpoint tensor must find a model tensor and the other
way round; an unmatched name is an error that names it. Only ``_extra_state`` entries (TE's FP8
metadata, empty here) may be missing on either side.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from mcore_npu.transformer import megatron_features

LATEST = "latest"
STEP_PREFIX = "step_"
COMPLETE_MARK = "metadata.json"  # Megatron writes it after every rank's data is on disk


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message is one line with the fix."""


def step_dir(checkpoint_dir: str | Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"{STEP_PREFIX}{step:07d}"


def step_of(path: Path) -> int | None:
    """The step of a ``step_<N>`` folder name, else None."""
    digits = path.name[len(STEP_PREFIX) :]
    return int(digits) if path.name.startswith(STEP_PREFIX) and digits.isdigit() else None


def step_dirs(checkpoint_dir: str | Path) -> list[Path]:
    """Every ``step_<N>`` folder under ``checkpoint_dir``, newest (highest step) first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of, reverse=True)


def read_latest(checkpoint_dir: str | Path) -> tuple[Path | None, str]:
    """``(folder named by latest, or None; what state latest is in, in words)``."""
    marker = Path(checkpoint_dir) / LATEST
    if not marker.is_file():
        return None, "latest is missing"
    try:
        name = marker.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as err:
        return None, f"latest is unreadable ({type(err).__name__})"
    if not name:
        return None, "latest is empty"
    path = Path(checkpoint_dir) / name
    if "/" in name or step_of(path) is None:
        return None, f"latest holds {name[:40]!r}, not a step folder name"
    if not path.is_dir():
        return None, f"latest names {name}, which does not exist"
    return path, f"latest names {name}"


def write_latest(checkpoint_dir: str | Path, target: Path) -> None:
    """Point ``latest`` at ``target``: write a temporary file, fsync, rename, fsync the folder."""
    root = Path(checkpoint_dir)
    tmp = root / f".{LATEST}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(target.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def diagnose(path: str | Path) -> str | None:
    """What is wrong with the checkpoint folder ``path`` (one phrase naming the file), or None.

    Checks without loading: the completion mark, ``common.pt``, the ``.metadata`` index, and that
    every ``.distcp`` file it names exists and is long enough for the bytes it should hold.
    """
    path = Path(path)
    mark = path / COMPLETE_MARK
    if not mark.is_file():
        return f"{COMPLETE_MARK} is missing (the save did not finish)"
    try:
        json.loads(mark.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return f"{COMPLETE_MARK} is unreadable ({type(err).__name__})"
    if _writes_common_file() and not (path / "common.pt").is_file():
        return "common.pt is missing"
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = pickle.load(f)
        storage = metadata.storage_data
    except FileNotFoundError:
        return ".metadata is missing"
    except Exception as err:  # any unpickling failure means the index is damaged
        return f".metadata is unreadable ({type(err).__name__})"
    return _check_data_files(path, storage)


def _writes_common_file() -> bool:
    """Whether the installed megatron-core saves the common state as ``common.pt`` (<= 0.18);
    0.19+ writes it into the ``.distcp`` files (the sharded object ``common_state``) and reads a
    ``common.pt`` only from older checkpoints."""
    return megatron_features.has("checkpoint_common_file")


def _check_data_files(path: Path, storage) -> str | None:
    needed: dict[str, int] = {}
    try:
        for info in storage.values():
            end = int(info.offset) + int(info.length)
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    except (AttributeError, TypeError, ValueError):
        return ".metadata is unreadable (unexpected content)"
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        actual = file.stat().st_size
        if actual < size:
            return f"{name} is truncated ({actual} of {size} bytes)"
    return None


def save(state: dict, checkpoint_dir: str | Path, step: int) -> Path:
    """Save ``state`` (sharded tensors + plain objects) as ``step_<step>`` and mark it latest.

    Raises:
        CheckpointError: the save failed (disk full, unwritable folder, ...): the message names
            the folder and the cause; ``latest`` still names the previous checkpoint.
    """
    from megatron.core import dist_checkpointing

    target = step_dir(checkpoint_dir, step)
    failure = None
    if dist.get_rank() == 0:
        failure = _fresh_folder(target)
    failure = _agree_on_failure(failure)
    if failure is None:
        try:
            dist_checkpointing.save(state, str(target), sharded_strategy=sync_save_strategy())
        except _save_errors() as err:  # every rank sees the failure (torch gathers it)
            failure = _cause(err, target)
        failure = _agree_on_failure(failure)
    if failure is not None:
        if dist.get_rank() == 0:
            shutil.rmtree(target, ignore_errors=True)  # incomplete: free its space
        previous, _ = read_latest(checkpoint_dir)
        kept = f"{previous.name} is still the latest valid checkpoint" if previous else (
            "no earlier checkpoint exists")  # fmt: skip
        raise CheckpointError(
            f"saving checkpoint {target} failed: {failure}; {kept}; free space or pick another "
            "train.checkpoint_dir, then resume with train.resume=true"
        )
    if dist.get_rank() == 0:
        write_latest(checkpoint_dir, target)
    dist.barrier()
    return target


OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")
"""Keys of the optimizer's sharded state on disk: ``optimizer.`` for one optimizer,
``chained_{i}.optimizer.`` for Megatron's ``ChainedOptimizer`` (an MoE model's dense and expert
parameters, each its own optimizer)."""
COMMON_STATE_KEY = "common_state"
"""The sharded object megatron-core 0.19+ saves the common state as (``serialization.save``);
not a model tensor. Earlier releases write ``common.pt`` instead and have no such key."""


def match_layout(model_state: dict, path: str | Path) -> dict:
    """``model_state`` (a model's ``sharded_state_dict()``) renamed to the names on disk.

    Each value's ``key`` becomes the checkpoint's name for the same tensor (either layout); values
    whose name the checkpoint lacks are dropped (only ``_extra_state`` entries may be). Build the
    optimizer's template from the result, so that its keys follow. Changes the values in place.

    Raises:
        CheckpointError: no readable checkpoint at ``path`` (as ``load`` says it).
        ValueError: a model tensor without a checkpoint tensor or the reverse, each named.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from mcore_npu.transformer.param_layout import match_names, mismatch_error, unused_names

    problem = diagnose(path) if Path(path).is_dir() else "the folder does not exist"
    if problem is not None:  # the same files on every rank: every rank raises here
        raise CheckpointError(f"checkpoint {path}: {problem}")
    on_disk = load_sharded_metadata(str(path))
    names = {value.key for value in on_disk.values()}  # objects are listed once per shard
    source = [name for name in names
              if not OPTIMIZER_KEY.match(name) and name != COMMON_STATE_KEY]  # fmt: skip
    written = {id(value): _written_keys(value) for value in nested_values(model_state)}
    target = {key for keys in written.values() for key in keys}
    try:
        matched = match_names(source, sorted(target), every_source=False)
        unused = unused_names(source, _taken_by_any_rank(set(matched.values())))
        if unused:
            raise mismatch_error([], unused)
    except ValueError as err:
        raise ValueError(f"checkpoint {path}: {err}") from None
    kept = {}
    for name, value in model_state.items():
        keys = written[id(value)]
        if keys == [value.key] and value.key in matched:
            value.key = matched[value.key]
            kept[name] = value
        elif keys != [value.key] and all(matched.get(key) == key for key in keys):
            kept[name] = value  # a factory whose split tensors are on disk under their names
    return kept


def _written_keys(value) -> list[str]:
    """The checkpoint names ``value`` writes: its key, or for a ``ShardedTensorFactory`` that
    splits a tensor under new names (the GDN layer's ``in_proj.weight.query`` ...) those."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if not isinstance(value, ShardedTensorFactory):
        return [value.key]
    return sorted({part.key for part in nested_values(value.build())})


def _taken_by_any_rank(taken: set[str]) -> set[str]:
    """The union over all ranks: each pipeline stage / expert rank takes its part."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return taken
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, taken)
    return set().union(*gathered)


def _save_errors() -> tuple[type[BaseException], ...]:
    """What a failed save or load raises: torch's ``CheckpointException`` is a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _fresh_folder(target: Path) -> str | None:
    try:
        if target.exists():  # left by an interrupted save of this step: never complete
            shutil.rmtree(target)
        target.mkdir(parents=True)
    except OSError as err:
        return _os_problem(err)
    return None


def _agree_on_failure(failure: str | None) -> str | None:
    """The first failure of any rank, known on every rank."""
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    return next((f for f in failures if f), None)


def _cause(err: BaseException, target: Path) -> str:
    """The root cause of a failed save, in words; 'no space left on device' when it is that."""
    for exc in _chain(err):
        if isinstance(exc, OSError) and exc.errno is not None:
            return _os_problem(exc)
    free = _free_bytes(target)
    if free is not None and free < 1 << 20:
        return f"no space left on device ({free} bytes free) ({type(err).__name__})"
    return f"{type(err).__name__}: {_first_line(err)}"


def _chain(err: BaseException):
    seen, todo = set(), [err]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        yield exc
        todo.extend([exc.__cause__, exc.__context__])
        for value in getattr(exc, "failures", {}).values():  # torch's CheckpointException
            todo.append(value[0] if isinstance(value, tuple) else value)


def _os_problem(err: OSError) -> str:
    if err.errno == errno.ENOSPC:
        return f"no space left on device ({err.filename or ''})".replace(" ()", "")
    if err.errno == errno.EFBIG:
        return "file too large: a file-size limit was hit (ulimit -f)"
    return f"{err.strerror or err} ({err.filename})" if err.filename else str(err)


def _free_bytes(path: Path) -> int | None:
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def load(template: dict, path: str | Path) -> dict:
    """Load ``path`` into the shapes of ``template`` (this process's sharded state dict).

    Raises:
        CheckpointError: one line naming the folder, the damaged file and what is wrong.
    """
    from megatron.core import dist_checkpointing

    path = Path(path)
    problem = diagnose(path) if path.is_dir() else "the folder does not exist"
    if problem is None:
        try:
            return dist_checkpointing.load(template, str(path))
        except _save_errors() as err:
            problem = f"loading failed ({type(err).__name__}: {_first_line(err)})"
    raise CheckpointError(f"checkpoint {path}: {problem}")


def _first_line(err: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err)).strip()  # no terminal colour codes
    return text.splitlines()[0][:300] if text else ""


def sync_save_strategy():
    """Megatron's ``torch_dist`` v1 format, written in this process by PyTorch's FileSystemWriter
    (one thread, fsync'ed files, no helper process). Megatron loads it with its own strategy."""
    return _strategy_class()()


@functools.cache
def _strategy_class():
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint as dcp

    class _SyncTorchDistSave(TorchDistSaveShardedStrategy):
        """Same keys, planner and files as Megatron's ``torch_dist`` v1; no helper process.

        A ``TorchDistSaveShardedStrategy`` (only its ``save`` is replaced): megatron-core
        0.18+'s ``dist_checkpointing.save`` swaps any other strategy for its default one, whose
        writer runs in a spawned helper process (0.15-0.17 take any ``SaveShardedStrategy``)."""

        def __init__(self) -> None:
            super().__init__("torch_dist", 1)

        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            writer = dcp.FileSystemWriter(
                str(checkpoint_dir), single_file_per_rank=True, sync_files=True, thread_count=1
            )
            dcp.save(
                mcore_to_pyt_state_dict(state, False),
                storage_writer=writer,
                planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
            )

    return _SyncTorchDistSave
