"""Sharded checkpoints through ``megatron.core.dist_checkpointing``, saved synchronously.

``<checkpoint_dir>/step_<N>`` holds the model and optimizer as sharded tensors (they load at
another parallel layout) plus common state (step, scheduler, config): ``common.pt`` (megatron-core
<= 0.18), one ``.distcp`` file per rank, ``.metadata``, and ``metadata.json``, written last.
``<checkpoint_dir>/latest`` names the newest complete one, replaced atomically after every rank
finished (docs/train.md). Saving runs in this process: no writer process that could outlive a
killed trainer. ``match_layout`` loads into either parameter layout (te or local).
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
    """What is wrong with the checkpoint folder ``path`` (one phrase naming the file), or None:
    the completion mark, ``common.pt``, ``.metadata``, every ``.distcp`` there and long enough."""
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
    """Whether the installed megatron-core saves ``common.pt`` (<= 0.18; 0.19+ keeps the common
    state in the ``.distcp`` files)."""
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
    """Save ``state`` (sharded tensors + plain objects) as ``step_<step>`` and mark it latest; else
    ``CheckpointError`` naming the folder and the cause, ``latest`` unchanged."""
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
        kept = "no earlier checkpoint exists"
        if previous:
            kept = f"{previous.name} is still the latest valid checkpoint"
        raise CheckpointError(
            f"saving checkpoint {target} failed: {failure}; {kept}; free space or pick another "
            "train.checkpoint_dir, then resume with train.resume=true"
        )
    if dist.get_rank() == 0:
        write_latest(checkpoint_dir, target)
    dist.barrier()
    return target


OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")
"""Keys of the optimizer's sharded state on disk (``chained_{i}.``: a ``ChainedOptimizer``'s)."""
COMMON_STATE_KEY = "common_state"
"""The sharded object megatron-core 0.19+ saves the common state as; not a model tensor."""


def match_layout(model_state: dict, path: str | Path) -> dict:
    """``model_state`` (a ``sharded_state_dict()``) renamed in place to the names on disk; values
    the checkpoint lacks are dropped (only ``_extra_state`` may be). ``CheckpointError``
    (unreadable) or ``ValueError`` (a tensor on one side only, named)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    from mcore_npu.transformer.param_layout import match_names, mismatch_error, unused_names

    problem = diagnose(path) if Path(path).is_dir() else "the folder does not exist"
    if problem is not None:  # the same files on every rank: every rank raises here
        raise CheckpointError(f"checkpoint {path}: {problem}")
    on_disk = load_sharded_metadata(str(path))
    names = {value.key for value in on_disk.values()}  # objects are listed once per shard
    source = [n for n in names if not OPTIMIZER_KEY.match(n) and n != COMMON_STATE_KEY]
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
    """Load ``path`` into the shapes of ``template`` (this process's sharded state dict); else
    ``CheckpointError``, one line naming the folder, the damaged file and what is wrong."""
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
    (one thread, fsync'ed files, no helper process)."""
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
        """Megatron's ``torch_dist`` v1 with its ``save`` replaced (a subclass, because
        megatron-core 0.18+ swaps any other strategy for its default one)."""

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
