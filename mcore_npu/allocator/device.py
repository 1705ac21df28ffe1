"""Accelerator detection and the allocator's expandable segments (docs/expandable_segments.md).

Decided when a function is *called*: importing this module imports neither torch nor torch_npu.
Detection prefers an Ascend NPU (``torch.npu`` present or importable now, and available), then
CUDA, then the CPU; a torch_npu that cannot load means ``"cpu"`` (:func:`npu_import_error` says
why). The switch only decides where *new* segments come from. The one mutable object is
``_STATE``: the value last put in effect per accelerator and the torch_npu import error.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from mcore_npu._optional import load
from mcore_npu._warnings import WARNED

if TYPE_CHECKING:
    import types

    import torch

__all__ = [
    "Accelerator",
    "ExpandableSegmentsWarning",
    "current_accelerator",
    "current_device",
    "expandable_segments",
    "is_npu_available",
    "npu_import_error",
    "set_expandable_segments",
]

logger = logging.getLogger(__name__)

Accelerator = Literal["npu", "cuda", "cpu"]

NPU_ALLOC_CONF = "PYTORCH_NPU_ALLOC_CONF"
CUDA_ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
GENERIC_ALLOC_CONF = "PYTORCH_ALLOC_CONF"

# Allocator-configuration variables per accelerator, in the order they are read (released
# torch_npu reads only the first; its master also PYTORCH_ALLOC_CONF).
ALLOCATOR_CONF_VARS: dict[str, tuple[str, ...]] = {
    "npu": (NPU_ALLOC_CONF, GENERIC_ALLOC_CONF),
    "cuda": (CUDA_ALLOC_CONF, GENERIC_ALLOC_CONF),
    "cpu": (),
}

_KEY = "expandable_segments"
# Options the allocator refuses to combine with expandable_segments:True
CONFLICTING_OPTIONS = ("max_split_size_mb", "garbage_collection_threshold")

# First torch-npu releases with torch.npu.memory._set_allocator_settings (detected by attribute)
NPU_SETTER_RELEASES = "2.6.0.post5, 2.7.1.post2, 2.8.0.post2, 2.9.0 or later"


class ExpandableSegmentsWarning(UserWarning):
    """Expandable segments could not be set as asked, or the allocator configuration conflicts
    (each distinct warning once per process)."""


@dataclass
class _DeviceState:
    """The only mutable state of this module (``_STATE``): ``last_set`` (accelerator -> the value
    last put in effect, which :func:`expandable_segments` restores) and ``npu_import_error`` (never
    retried: a half-loaded C extension cannot be re-imported reliably)."""

    last_set: dict[str, bool] = field(default_factory=dict)
    npu_import_error: str | None = None

    def reset(self) -> None:
        """Forget everything (for tests, or after the allocator was reconfigured elsewhere)."""
        self.last_set.clear()
        self.npu_import_error = None


_STATE = _DeviceState()


def _torch() -> types.ModuleType:
    """Import torch on first use (keeps ``import mcore_npu.allocator.device`` free of torch)."""
    import torch

    return torch


def _torch_npu_installed() -> bool:
    """Whether a ``torch_npu`` package can be found on ``sys.path`` (it is not imported)."""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):  # a broken entry in sys.modules / sys.path
        return False


def _record_npu_error(exc: BaseException) -> None:
    _STATE.npu_import_error = f"{type(exc).__name__}: {exc}"
    logger.debug("torch_npu is installed but cannot be imported: %s", _STATE.npu_import_error)


def _npu_module() -> types.ModuleType | None:
    """``torch.npu`` if torch_npu is loaded or loads now (installed, not failed before), or None."""
    try:
        torch = _torch()
    except Exception as exc:  # torch's backend autoload of a broken torch_npu fails `import torch`
        _record_npu_error(exc)
        return None
    npu = getattr(torch, "npu", None)
    if npu is not None:
        return npu
    if "torch_npu" in sys.modules or _STATE.npu_import_error is not None:
        return None
    if not _torch_npu_installed():
        return None
    try:
        load("torch_npu")
    except ImportError as exc:  # the cause: ImportError, OSError, RuntimeError without CANN
        _record_npu_error(exc.__cause__ or exc)
        return None
    return getattr(torch, "npu", None)


def is_npu_available() -> bool:
    """Whether an Ascend NPU is usable in this process, decided now (importing torch_npu is the
    only side effect). Never raises."""
    npu = _npu_module()
    if npu is None:
        return False
    try:
        return bool(npu.is_available())
    except Exception as exc:
        logger.debug("torch.npu.is_available() raised %s: %s", type(exc).__name__, exc)
        return False


def _cuda_available() -> bool:
    try:
        return bool(_torch().cuda.is_available())
    except Exception as exc:
        logger.debug("torch.cuda.is_available() raised %s: %s", type(exc).__name__, exc)
        return False


def current_accelerator() -> Accelerator:
    """``"npu"``, ``"cuda"`` or ``"cpu"``: the accelerator this process would use now (not cached;
    an NPU wins over CUDA). Never raises."""
    if is_npu_available():
        return "npu"
    if _cuda_available():
        return "cuda"
    return "cpu"


def npu_import_error() -> str | None:
    """Why torch_npu could not be imported (``"ExceptionType: message"``), or None (not
    installed, or imported). Runs detection first."""
    _npu_module()
    return _STATE.npu_import_error


def current_device() -> torch.device:
    """The device new tensors should go to: ``npu:<i>``, ``cuda:<i>`` (the current index; this
    initialises the accelerator's runtime) or ``cpu``."""
    torch = _torch()
    accelerator = current_accelerator()
    if accelerator == "npu":
        return torch.device("npu", torch.npu.current_device())
    if accelerator == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _split_entries(conf: str) -> list[str]:
    """Split an allocator configuration at top-level commas (not inside ``[...]``)."""
    entries: list[str] = []
    depth = 0
    current: list[str] = []
    for char in conf:
        if char == "[":
            depth += 1
        elif char == "]":
            depth = max(depth - 1, 0)
        if char == "," and depth == 0:
            entries.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    entries.append("".join(current).strip())
    return [entry for entry in entries if entry]


def _entry_key(entry: str) -> str:
    return entry.split(":", 1)[0].strip()


def parse_alloc_conf(conf: str | None) -> dict[str, str]:
    """``"a:1, b:[x:1,y:2]"`` -> ``{"a": "1", "b": "[x:1,y:2]"}`` (spaces removed, last wins)."""
    parsed: dict[str, str] = {}
    for entry in _split_entries(conf or ""):
        key, _, value = entry.partition(":")
        parsed[key.strip()] = value.replace(" ", "")
    return parsed


def _merge_conf(conf: str | None, key: str, value: str) -> str:
    """Set ``key:value`` in an allocator configuration, keeping every other entry as written
    (the first ``key`` entry replaced in place, later ones dropped; appended if missing)."""
    merged: list[str] = []
    replaced = False
    for entry in _split_entries(conf or ""):
        if _entry_key(entry) != key:
            merged.append(entry)
        elif not replaced:
            merged.append(f"{key}:{value}")
            replaced = True
    if not replaced:
        merged.append(f"{key}:{value}")
    return ",".join(merged)


def _setting(enable: bool) -> str:
    return f"{_KEY}:{enable}"


def _value_from_env(accelerator: str) -> bool | None:
    """The expandable_segments value in the accelerator's configuration variables, if any."""
    for var in ALLOCATOR_CONF_VARS.get(accelerator, ()):
        value = parse_alloc_conf(os.environ.get(var)).get(_KEY)
        if value is not None:
            return value == "True"
    return None


def _previous_value(accelerator: str) -> bool:
    """Best knowledge of the current setting: our last successful call, else the env, else off."""
    if accelerator in _STATE.last_set:
        return _STATE.last_set[accelerator]
    return bool(_value_from_env(accelerator))


def _warn_once(key: str, message: str) -> None:
    """Emit ``message`` as an :class:`ExpandableSegmentsWarning` the first time ``key`` is seen."""
    if not WARNED.first_time(f"device:{key}"):
        return
    warnings.warn(message, ExpandableSegmentsWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """``stacklevel`` that points a warning at the first frame outside mcore_npu and contextlib."""
    level = 2  # 1 would be _warn_once's call to warnings.warn; count from its caller
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith("mcore_npu.") or module == "contextlib"):
            return level
        frame = frame.f_back
        level += 1
    return 2


def _not_in_effect(
    key: str, problem: str, fix: str, *, strict: bool, cause: BaseException | None = None
) -> bool:
    """Report a setting that cannot take effect: raise if ``strict``, else warn once. -> False."""
    if strict:
        raise RuntimeError(f"{problem}\nFix: {fix}") from cause
    _warn_once(key, f"{problem} Fix: {fix} (pass strict=True to make this an error)")
    return False


def require_bool(where: str, name: str, value: object) -> None:
    """Raise TypeError unless ``value`` is a real bool (1, "yes", numpy bools are refused)."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{where}: {name} must be a bool, got {value!r} ({type(value).__name__}). "
            f"Pass {name}=True or {name}=False."
        )


def _warn_about_reset(accelerator: str) -> None:
    """Warn once that the runtime setter resets the options of the configuration variables."""
    for var in ALLOCATOR_CONF_VARS[accelerator]:
        options = sorted(key for key in parse_alloc_conf(os.environ.get(var)) if key != _KEY)
        if not options:
            continue
        conflicts = [key for key in options if key in CONFLICTING_OPTIONS]
        conflict_note = (
            f" {' and '.join(conflicts)} cannot be combined with expandable segments anyway."
            if conflicts
            else ""
        )
        _warn_once(
            f"reset:{accelerator}:{var}:{','.join(options)}",
            f"{var}={os.environ[var]!r} sets {', '.join(options)}; the runtime allocator setter "
            f"resets these options to their defaults, so they no longer apply in this process."
            f"{conflict_note} Fix: remove them from {var}, or, if this process needs them, do "
            f"not change expandable segments at run time in it.",
        )


def _call_setter(
    accelerator: str, setter: Callable[[str], object], name: str, enable: bool, strict: bool
) -> bool:
    """Call ``setter("expandable_segments:<enable>")``; record the value if it succeeds."""
    _warn_about_reset(accelerator)
    try:
        setter(_setting(enable))
    except Exception as exc:
        return _not_in_effect(
            f"setter-failed:{accelerator}:{enable}",
            f"{name}({_setting(enable)!r}) raised {type(exc).__name__}: {exc}",
            "check that the driver supports virtual memory (Ascend HDK >= 23.0.0; a CUDA driver "
            "with cuMemMap) and that the device is set, or leave expandable segments off",
            strict=strict,
            cause=exc,
        )
    _STATE.last_set[accelerator] = enable
    logger.debug("%s(%r) applied", name, _setting(enable))
    return True


def _npu_allocator_initialized(npu: types.ModuleType) -> bool:
    """Whether the NPU allocator may already have read ``PYTORCH_NPU_ALLOC_CONF``: probed with
    ``torch.npu.is_initialized()`` (initialises nothing); "yes" if that is missing or raises."""
    probe = getattr(npu, "is_initialized", None)
    if not callable(probe):
        return True
    try:
        return bool(probe())
    except Exception:
        return True


def _set_npu_env(enable: bool, strict: bool) -> bool:
    """Old torch-npu, allocator untouched: merge the setting into ``PYTORCH_NPU_ALLOC_CONF``."""
    current = os.environ.get(NPU_ALLOC_CONF)
    conflicts = [key for key in CONFLICTING_OPTIONS if key in parse_alloc_conf(current)]
    if enable and conflicts:
        return _not_in_effect(
            f"env-conflict:npu:{','.join(conflicts)}",
            f"{NPU_ALLOC_CONF}={current!r} sets {', '.join(conflicts)}; torch-npu refuses to "
            f"combine that with expandable_segments:True (the first NPU allocation would fail), "
            f"so {NPU_ALLOC_CONF} was left unchanged and expandable segments stay off.",
            f"remove {', '.join(conflicts)} from {NPU_ALLOC_CONF}, or upgrade torch-npu to "
            f"{NPU_SETTER_RELEASES} (its runtime setter resets those options instead)",
            strict=strict,
        )
    os.environ[NPU_ALLOC_CONF] = _merge_conf(current, _KEY, str(enable))
    _STATE.last_set["npu"] = enable
    logger.info(
        "torch.npu.memory._set_allocator_settings is missing (torch-npu older than %s); set %s=%r "
        "instead. It is read when the NPU allocator initialises and is inherited by child "
        "processes.",
        NPU_SETTER_RELEASES,
        NPU_ALLOC_CONF,
        os.environ[NPU_ALLOC_CONF],
    )
    return True


def _set_on_npu(enable: bool, strict: bool) -> bool:
    npu = _torch().npu
    setter = getattr(getattr(npu, "memory", None), "_set_allocator_settings", None)
    if callable(setter):
        name = "torch.npu.memory._set_allocator_settings"
        return _call_setter("npu", setter, name, enable, strict)
    if not _npu_allocator_initialized(npu):
        return _set_npu_env(enable, strict)
    if _previous_value("npu") == enable:
        return True  # already what the allocator read at initialisation: nothing to change
    return _not_in_effect(
        f"npu-no-setter:{enable}",
        f"Cannot set expandable_segments:{enable} on the NPU: this torch-npu has no "
        f"torch.npu.memory._set_allocator_settings and the NPU allocator is already initialised, "
        f"so {NPU_ALLOC_CONF} is no longer read.",
        f"upgrade torch-npu to {NPU_SETTER_RELEASES} (Ascend Extension for PyTorch 7.3.0), or "
        f"call set_expandable_segments before the first NPU allocation / torch.npu.set_device, "
        f"or export {NPU_ALLOC_CONF}=expandable_segments:{enable} before starting the process",
        strict=strict,
    )


def _set_on_cuda(enable: bool, strict: bool) -> bool:
    torch = _torch()
    generic = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if callable(generic):
        name = "torch._C._accelerator_setAllocatorSettings"
        return _call_setter("cuda", generic, name, enable, strict)
    legacy = getattr(getattr(torch.cuda, "memory", None), "_set_allocator_settings", None)
    if callable(legacy):
        name = "torch.cuda.memory._set_allocator_settings"
        return _call_setter("cuda", legacy, name, enable, strict)
    return _not_in_effect(
        f"cuda-no-setter:{enable}",
        f"Cannot set expandable_segments:{enable} on CUDA: torch {torch.__version__} has "
        f"neither torch._C._accelerator_setAllocatorSettings nor "
        f"torch.cuda.memory._set_allocator_settings.",
        f"upgrade torch (>= 2.1), or export {CUDA_ALLOC_CONF}=expandable_segments:{enable} "
        f"before the first CUDA allocation",
        strict=strict,
    )


def set_expandable_segments(enable: bool, *, strict: bool = False) -> bool:
    """Turn the caching allocator's expandable segments on or off for *new* allocations.

    Returns whether new allocations on this accelerator follow ``enable`` (CPU: False); if not, it
    warns once, or raises ``RuntimeError`` with ``strict=True``. Per accelerator and torch-npu
    version: docs/expandable_segments.md#what-the-return-value-means."""
    require_bool("set_expandable_segments", "enable", enable)
    require_bool("set_expandable_segments", "strict", strict)
    accelerator = current_accelerator()
    if accelerator == "npu":
        return _set_on_npu(enable, strict)
    if accelerator == "cuda":
        return _set_on_cuda(enable, strict)
    logger.debug("no accelerator: expandable_segments:%s has nothing to configure", enable)
    return False


@contextlib.contextmanager
def expandable_segments(enable: bool, *, strict: bool = False) -> Iterator[bool]:
    """Set expandable segments for a ``with`` block (e.g. off around IPC exports), then restore the
    value this module last put in effect (else the configuration variable's, else False); yields
    what ``set_expandable_segments`` returned. A failed restore during an exception only warns."""
    require_bool("expandable_segments", "enable", enable)
    require_bool("expandable_segments", "strict", strict)
    previous = _previous_value(current_accelerator())
    in_effect = set_expandable_segments(enable, strict=strict)
    must_restore = in_effect and previous != enable
    try:
        yield in_effect
    except BaseException:
        if must_restore:
            set_expandable_segments(previous, strict=False)
        raise
    if must_restore:
        set_expandable_segments(previous, strict=strict)
