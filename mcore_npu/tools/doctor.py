"""``mcore-npu doctor``: what this environment can run, and what is wrong with it.

:func:`gather_checks` collects the facts as a list of :class:`Check`, one per line of the report
(docs/doctor.md lists them); :func:`format_text` and :func:`format_json` render them. Nothing
here raises: every check runs guarded, and an unexpected failure inside one becomes an ``error``
check. torch, megatron-core and transformer-engine are imported only when a check runs;
torch_npu once, through ``mcore_npu.allocator.device.npu_import_error``, so that the rest of the
package sees the same outcome and nothing re-imports a half-loaded extension.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import types
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from mcore_npu.allocator import device as accelerators
from mcore_npu.ops.registry import OPERATORS

OPERATOR_NAMES = tuple(OPERATORS)

__all__ = [
    "Check",
    "add_arguments",
    "diagnose_npu_error",
    "format_json",
    "format_text",
    "gather_checks",
    "run",
]

OK, WARN, ERROR = "ok", "warn", "error"

CANN_VARIABLES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")
AUTOLOAD_VARIABLE = "TORCH_DEVICE_BACKEND_AUTOLOAD"
DEFAULT_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"
SET_ENV_CANDIDATES = (  # a default root install, a user install, the newer layout
    DEFAULT_SET_ENV,
    "~/Ascend/ascend-toolkit/set_env.sh",
    "/usr/local/Ascend/cann/set_env.sh",
)
# Substrings of an import error that point at a missing CANN library / an unsourced CANN env.
CANN_MARKERS = (
    "libhccl",
    "libascend",
    "libacl",
    "libopapi",
    "libge_runner",
    "libgraph",
    "libruntime",
    "cann package",
    "set_env.sh",
    "ascend-toolkit",
)
SUPPORTED_MEGATRON = ((0, 15), (0, 20))  # >= 0.15, < 0.20 (pyproject.toml)
ALLOC_VARIABLES = (
    accelerators.NPU_ALLOC_CONF,
    accelerators.CUDA_ALLOC_CONF,
    accelerators.GENERIC_ALLOC_CONF,
)


@dataclass(frozen=True)
class Check:
    """One line of the report: ``status`` is ``"ok"``, ``"warn"`` (works, but worth a look) or
    ``"error"`` (broken); ``cause`` and ``fix`` are filled in for problems."""

    name: str
    status: str
    detail: str
    cause: str = ""
    fix: str = ""

    @property
    def problem(self) -> bool:
        return self.status != OK


@dataclass
class _Probe:
    """What the checks share: the outcome of ``import torch`` (made once)."""

    torch: types.ModuleType | None = None
    torch_error: BaseException | None = None
    accelerator: str | None = None


def _distribution_version(*names: str) -> str | None:
    """The installed version of the first of ``names`` that pip knows, else None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except Exception:  # PackageNotFoundError, or broken metadata
            continue
    return None


def _module_origin(name: str) -> str | None:
    """Where ``import name`` would load from (without importing it), or None."""
    try:
        spec = importlib.util.find_spec(name)
    except Exception:  # a broken entry in sys.modules / sys.path
        return None
    if spec is None:
        return None
    return spec.origin or ", ".join(spec.submodule_search_locations or []) or name


def _describe(exc: BaseException) -> str:
    """``"Type: message"`` on one line."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a ``raise ... from ...`` / implicit chain."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or exc.__context__
        if inner is None or id(inner) in seen:
            return exc
        seen.add(id(inner))
        exc = inner


def _release(version: str | None) -> tuple[int, ...] | None:
    """``"2.6.0.post5"`` / ``"2.6.0+cpu"`` -> ``(2, 6, 0)``; None if unparsable."""
    if not version:
        return None
    try:
        from packaging.version import Version

        return Version(version).release[:3]
    except Exception:  # packaging missing, or InvalidVersion
        return None


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in release)


def _quiet_import(name: str) -> types.ModuleType:
    """Import a module with its import-time warnings silenced (megatron warns about TE/Apex)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def _set_env_path() -> str:
    """The CANN ``set_env.sh`` found on this machine, else the default install path."""
    for candidate in SET_ENV_CANDIDATES:
        path = Path(candidate).expanduser()
        if path.is_file():
            return str(path)
    return DEFAULT_SET_ENV


def _autoload_enabled() -> bool:
    """torch's rule: autoload unless TORCH_DEVICE_BACKEND_AUTOLOAD is set to something not "1"."""
    return os.environ.get(AUTOLOAD_VARIABLE, "1") == "1"


def _backend_entry_points() -> list[str]:
    """Names of the ``torch.backends`` entry points torch would autoload (``["torch_npu"]``)."""
    try:
        return sorted(ep.name for ep in importlib.metadata.entry_points(group="torch.backends"))
    except Exception:
        return []


def diagnose_npu_error(
    error: str, torch_version: str | None, npu_version: str | None
) -> tuple[str, str]:
    """The likely ``(cause, fix)`` of a torch_npu import failure ``error`` (``"Type: message"``
    or the message), given the torch and torch-npu versions (None if unknown)."""
    lowered = error.lower()
    causes, fixes = [], []
    if any(marker in lowered for marker in CANN_MARKERS):
        causes.append(
            "CANN environment not sourced (a CANN library such as libhccl.so or "
            "libascendcl.so cannot be loaded)"
        )
        fixes.append(
            f"source {_set_env_path()} (from the CANN install) in this shell before "
            "starting Python; install the CANN toolkit if it is missing"
        )
    elif "cannot open shared object file" in lowered:
        causes.append(
            "a shared library cannot be loaded (most often the CANN environment is not sourced)"
        )
        fixes.append(f"source {_set_env_path()}, then check LD_LIBRARY_PATH")
    if "two accelerators" in lowered:
        causes.append("torch is a CUDA build; torch-npu needs the CPU build of the same version")
        fixes.append(
            "pip install the CPU wheel of torch (--index-url "
            "https://download.pytorch.org/whl/cpu) matching torch-npu"
        )
    mismatch = _version_mismatch(torch_version, npu_version)
    if mismatch:
        causes.append(mismatch)
        base = _dotted(_release(npu_version) or ())
        fixes.append(
            f"install the torch-npu build for torch {torch_version} "
            f"(pip install 'torch-npu=={_dotted(_release(torch_version) or ())}.*'), "
            f"or torch=={base}"
        )
    elif "undefined symbol" in lowered:
        causes.append("an ABI mismatch: torch-npu was built against another torch")
        fixes.append("reinstall the torch-npu build made for this exact torch version")
    if not causes:
        causes.append("not recognised; see the error text")
        fixes.append(
            f"run `python -c 'import torch_npu'` after `source {_set_env_path()}` and "
            "read the full traceback"
        )
    return "; ".join(causes), "; ".join(fixes)


def _version_mismatch(torch_version: str | None, npu_version: str | None) -> str:
    """A sentence if torch-npu X.Y.Z(.postN) was built for another torch than X.Y.Z, else ""."""
    torch_release, npu_release = _release(torch_version), _release(npu_version)
    if torch_release is None or npu_release is None or torch_release == npu_release:
        return ""
    return (
        f"torch {torch_version} does not match torch-npu {npu_version} (built for torch "
        f"{_dotted(npu_release)})"
    )


def _probe_torch() -> _Probe:
    try:
        return _Probe(torch=importlib.import_module("torch"))
    except Exception as exc:  # e.g. RuntimeError from the autoload of a broken torch_npu
        return _Probe(torch_error=exc)


def _not_checked(name: str) -> Check:
    return Check(name, WARN, "not checked: torch does not import (see the torch line)")


def check_python(probe: _Probe) -> Check:
    """The interpreter (pyproject requires >= 3.10, so an older one never gets here)."""
    return Check("python", OK, f"{platform.python_version()} ({sys.executable})")


def check_torch(probe: _Probe) -> Check:
    if probe.torch is None:
        return _torch_failure(probe.torch_error)
    torch = probe.torch
    cuda = getattr(torch.version, "cuda", None)
    hip = getattr(torch.version, "hip", None)
    build = f"CUDA {cuda} build" if cuda else f"ROCm {hip} build" if hip else "CPU build"
    return Check("torch", OK, f"{torch.__version__} ({build})")


def _torch_failure(exc: BaseException | None) -> Check:
    installed = _distribution_version("torch")
    if exc is None or installed is None:
        fix = "pip install 'torch>=2.6' (the CPU build on Ascend machines)"
        return Check("torch", ERROR, "not installed", "torch is missing", fix)
    detail = f"{installed} installed but `import torch` fails: {_describe(exc)}"
    if "backend extension" in str(exc):
        root = _describe(_root_cause(exc))
        cause, fix = diagnose_npu_error(root, installed, _distribution_version("torch-npu"))
        cause = f"torch autoloads the torch_npu backend at import and it fails: {cause}"
        fix = f"{fix}; meanwhile {AUTOLOAD_VARIABLE}=0 lets `import torch` work without torch_npu"
        return Check("torch", ERROR, f"{detail} <- {root}", cause, fix)
    fix = "reinstall torch (pip install --force-reinstall torch==" + installed + ")"
    return Check("torch", ERROR, detail, "a broken torch installation", fix)


def check_megatron(probe: _Probe) -> Check:
    version = _distribution_version("megatron-core")
    fix = "pip install 'megatron-core>=0.15,<0.20'"
    if version is None:
        return Check("megatron-core", ERROR, "not installed", "megatron-core is missing", fix)
    if probe.torch is None:
        return _not_checked("megatron-core")
    try:
        _quiet_import("megatron.core")
    except Exception as exc:
        detail = f"{version} installed but does not import: {_describe(exc)}"
        cause = "a broken or incompatible megatron-core"
        fix = "pip install --force-reinstall 'megatron-core>=0.15,<0.20'"
        return Check("megatron-core", ERROR, detail, cause, fix)
    release = _release(version)
    low, high = SUPPORTED_MEGATRON
    if release is not None and not low <= release[:2] < high:
        cause = "outside the versions mcore-npu is tested with (>= 0.15, < 0.20)"
        return Check("megatron-core", WARN, f"{version}, imports", cause, fix)
    return Check("megatron-core", OK, f"{version}, imports")


def check_torch_npu(probe: _Probe) -> Check:
    version = _distribution_version("torch-npu")
    origin = _module_origin("torch_npu")
    if version is None and origin is None:
        detail = "not installed (fine without an NPU: the reference kernel runs on the CPU)"
        return Check("torch-npu", OK, detail)
    found = version or f"found at {origin}, no installed distribution"
    if probe.torch is None:
        if "backend extension" in str(probe.torch_error):
            cause = "its device-backend autoload makes `import torch` fail"
            cause += " (details on the torch line)"
            detail = f"{found}; does not load"
            return Check("torch-npu", ERROR, detail, cause, "see the torch line")
        return _not_checked("torch-npu")
    error = accelerators.npu_import_error()  # imports torch_npu once, guarded, if needed
    if error is not None:
        return _npu_import_failure(found, error, probe.torch.__version__, version)
    return _npu_imported(probe.torch, found, version)


def _npu_import_failure(found: str, error: str, torch_version: str, version: str | None) -> Check:
    cause, fix = diagnose_npu_error(error, torch_version, version)
    if "torch_npu" in _backend_entry_points() and not _autoload_enabled():
        fix += (
            f"; {AUTOLOAD_VARIABLE}={os.environ.get(AUTOLOAD_VARIABLE)} is what keeps this "
            "error out of `import torch`"
        )
    return Check("torch-npu", ERROR, f"{found}; does not import: {error}", cause, fix)


def _npu_imported(torch: types.ModuleType, found: str, version: str | None) -> Check:
    npu = getattr(torch, "npu", None)
    mismatch = _version_mismatch(torch.__version__, version)
    try:
        available = bool(npu.is_available()) if npu is not None else False
        count = int(npu.device_count()) if available else 0
    except Exception as exc:
        detail = f"{found}; imports, but torch.npu.is_available() raised {_describe(exc)}"
        fix = "run npu-smi info; check the driver (HDK) and the CANN version"
        return Check("torch-npu", ERROR, detail, "the NPU driver or runtime is broken", fix)
    if not available:
        cause = "no NPU device: the driver is not loaded or ASCEND_RT_VISIBLE_DEVICES hides them"
        fix = "run npu-smi info; check ASCEND_RT_VISIBLE_DEVICES"
        return Check("torch-npu", WARN, f"{found}; imports, but no NPU is visible", cause, fix)
    detail = f"{found}; imports; {count} NPU(s) visible"
    if mismatch:
        fix = "install the torch-npu build for this torch version"
        return Check("torch-npu", WARN, detail, mismatch, fix)
    return Check("torch-npu", OK, detail)


def check_cann(probe: _Probe) -> Check:
    values = {name: os.environ.get(name) for name in CANN_VARIABLES}
    library_path = os.environ.get("LD_LIBRARY_PATH", "")
    ascend_dirs = [p for p in library_path.split(os.pathsep) if "ascend" in p.lower()]
    shown = [f"{name}={value}" for name, value in values.items() if value]
    shown.append(f"LD_LIBRARY_PATH Ascend entries: {len(ascend_dirs)}")
    detail = ", ".join(shown)
    npu_wanted = _distribution_version("torch-npu") or _module_origin("torch_npu")
    missing_dirs = [f"{n}={v}" for n, v in values.items() if v and not Path(v).exists()]
    if missing_dirs:
        cause = f"{', '.join(missing_dirs)} does not exist"
        fix = f"source {_set_env_path()} again, from the CANN that is installed"
        return Check("cann", WARN, detail, cause, fix)
    if not any(values.values()) and not ascend_dirs:
        if not npu_wanted:
            return Check("cann", OK, "not sourced (not needed without torch_npu)")
        detail = "not sourced: " + ", ".join(f"{n} unset" for n in values)
        cause = "torch_npu is installed but the CANN environment is not set"
        return Check("cann", WARN, detail, cause, f"source {_set_env_path()}")
    return Check("cann", OK, detail)


def check_transformer_engine(probe: _Probe) -> Check:
    version = _distribution_version("transformer-engine", "transformer-engine-torch")
    origin = _module_origin("transformer_engine")
    if version is None and origin is None:
        detail = "not installed (optional: CUDA machines, backend 'te')"
        return Check("transformer-engine", OK, detail)
    found = version or f"found at {origin}"
    if probe.torch is None:
        return _not_checked("transformer-engine")
    try:
        _quiet_import("transformer_engine.pytorch")
    except Exception as exc:
        detail = f"{found}; does not import: {_describe(exc)}"
        cause = "backend 'auto' falls back to Megatron's local spec; backend 'te' fails"
        fix = (
            "on NPU/CPU machines pip uninstall transformer-engine; on CUDA install the "
            "build that matches torch and CUDA"
        )
        return Check("transformer-engine", WARN, detail, cause, fix)
    return Check("transformer-engine", OK, f"{found}, imports")


def check_accelerator(probe: _Probe) -> Check:
    if probe.torch is None:
        return _not_checked("accelerator")
    probe.accelerator = accelerators.current_accelerator()
    if probe.accelerator == "cpu":
        return Check("accelerator", OK, "cpu (no NPU or CUDA device; the reference kernel runs)")
    count = getattr(probe.torch, probe.accelerator).device_count()
    return Check("accelerator", OK, f"{probe.accelerator} ({count} device(s))")


def check_allocator_env(probe: _Probe) -> Check:
    """The allocator variables, and option combinations the allocator refuses: an error in a
    variable the current accelerator reads (its first allocation fails), else a warning."""
    values = {name: os.environ.get(name) for name in ALLOC_VARIABLES}
    detail = ", ".join(f"{n}={v!r}" for n, v in values.items() if v is not None) or (
        "none of " + ", ".join(ALLOC_VARIABLES) + " set (allocator defaults)"
    )
    read_now = _variables_read_by(probe.accelerator)
    status, causes, fixes = OK, [], []
    for name, value in values.items():
        conflict = _conflict(value)
        if conflict:
            causes.append(
                f"{name} combines expandable_segments:True with {conflict}, which "
                "the allocator refuses"
            )
            fixes.append(f"remove {conflict} or expandable_segments:True from {name}")
            status = _worst(status, ERROR if name in read_now else WARN)
    npu_var, generic = accelerators.NPU_ALLOC_CONF, accelerators.GENERIC_ALLOC_CONF
    if values[npu_var] is not None and values[generic] is not None:
        causes.append(f"both {npu_var} and {generic} are set (newer torch-npu refuses that)")
        fixes.append(f"unset {generic} and keep {npu_var}")
        status = _worst(status, WARN)
    return Check("allocator env", status, detail, "; ".join(causes), "; ".join(fixes))


def _worst(*statuses: str) -> str:
    return max(statuses, key=(OK, WARN, ERROR).index)


def _variables_read_by(accelerator: str | None) -> tuple[str, ...]:
    return accelerators.ALLOCATOR_CONF_VARS.get(accelerator or "cpu", ())


def _conflict(value: str | None) -> str:
    """``"max_split_size_mb"`` etc. if ``value`` also turns expandable segments on, else ""."""
    parsed = accelerators.parse_alloc_conf(value)
    if parsed.get("expandable_segments") != "True":
        return ""
    return " and ".join(k for k in accelerators.CONFLICTING_OPTIONS if k in parsed)


def check_allocator_setter(probe: _Probe) -> Check:
    name = "allocator setter"
    if probe.torch is None:
        return _not_checked(name)
    torch, accelerator = probe.torch, probe.accelerator or accelerators.current_accelerator()
    if accelerator == "npu":
        setter = "torch.npu.memory._set_allocator_settings"
        if _attribute(getattr(torch, "npu", None), "memory", "_set_allocator_settings"):
            return Check(name, OK, f"{setter} (expandable segments can be switched at run time)")
        cause = (
            "torch-npu older than the 7.3.0 release: expandable segments only through "
            f"{accelerators.NPU_ALLOC_CONF} before the first NPU allocation"
        )
        fix = f"upgrade torch-npu to {accelerators.NPU_SETTER_RELEASES}"
        return Check(name, WARN, f"{setter} missing", cause, fix)
    generic = _attribute(torch._C, "_accelerator_setAllocatorSettings")
    cuda = _attribute(getattr(torch, "cuda", None), "memory", "_set_allocator_settings")
    found = {
        "torch._C._accelerator_setAllocatorSettings": generic,
        "torch.cuda.memory._set_allocator_settings": cuda,
    }
    present = [setter for setter, ok in found.items() if ok]
    if accelerator == "cuda":
        if present:
            return Check(name, OK, present[0])
        fix = f"upgrade torch, or export {accelerators.CUDA_ALLOC_CONF}=expandable_segments:True"
        detail = "no runtime allocator setter in this torch"
        return Check(name, WARN, detail, "torch older than 2.1", fix)
    have = ", ".join(present) or "none"
    return Check(name, OK, f"not applicable on the CPU (torch has: {have})")


def _attribute(obj, *path: str) -> bool:
    """Whether ``obj.path[0].path[1]...`` exists and is callable (never raises)."""
    try:
        for name in path:
            obj = getattr(obj, name)
        return callable(obj)
    except Exception:
        return False


def check_attention(probe: _Probe) -> Check:
    if probe.torch is None:
        return _not_checked("attention")
    accelerator = probe.accelerator or accelerators.current_accelerator()
    registry = importlib.import_module("mcore_npu.ops.registry")
    kernel = registry.resolve("fusion_attention", "auto", probe.torch.device(accelerator)).kernel
    try:
        backend = _quiet_import("mcore_npu.transformer.backends").resolve_backend("auto")
    except Exception as exc:  # megatron-core missing or broken: reported on its own line
        detail = f"kernel {kernel}; backend unknown ({_describe(exc)})"
        cause = "the layer specs need megatron-core"
        return Check("attention", WARN, detail, cause, "see the megatron-core line")
    detail = f"auto -> backend {backend}, kernel {kernel} (on {accelerator})"
    if accelerator == "npu" and backend != "npu_fusion":
        cause = "an NPU is present but auto does not pick it"
        return Check("attention", WARN, detail, cause, "report this as a bug")
    return Check("attention", OK, detail)


def _typical_calls(torch) -> dict[str, list[tuple[str, dict]]]:
    """What the registry is told for an operator's line: the calls the NPU spec makes (bf16,
    head dims 128), labelled where an operator's choice depends on the call."""
    bf16 = types.SimpleNamespace(dtype=torch.bfloat16, shape=(1, 64, 4, 128))
    gdn = {"q": bf16, "v": bf16, "initial_state": None, "output_final_state": False}
    grouped = ("group_list", "split_item", "group_type", "group_list_type")
    return {
        "rotary_mul": [
            ("", {"rotary_mode": "half", "head_dim": 128}),
            ("interleaved", {"rotary_mode": "interleave", "head_dim": 128}),
        ],
        "grouped_matmul": [("", {"keywords": grouped})],
        "chunk_gated_delta_rule": [
            ("training", {**gdn, "grad": True}),
            ("forward-only", {**gdn, "grad": False}),
        ],
    }


def check_operator(name: str, probe: _Probe) -> Check:
    """What ``kernel="auto"`` runs for the registered operator ``name`` on NPU tensors here,
    and why (the registry's reasons), when torch_npu imports; else the reference."""
    label = f"op {name}"
    if probe.torch is None:
        return _not_checked(label)
    registry = importlib.import_module("mcore_npu.ops.registry")
    accelerator = probe.accelerator or accelerators.current_accelerator()
    if not registry.operator(name).kernels:
        return Check(label, OK, "the PyTorch reference everywhere (no Ascend kernel registered)")
    if _quiet_optional("torch_npu") is None:
        return Check(label, OK, f"auto -> reference on {accelerator} (no usable torch_npu)")
    parts, fell_back = [], False
    for call, facts in _typical_calls(probe.torch).get(name, [("", {})]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reasons are printed here instead
            resolution = registry.resolve(name, "auto", "npu", **facts)
        reasons = f" ({'; '.join(resolution.reasons)})" if resolution.reasons else ""
        parts.append(f"{call + ' ' if call else ''}-> {resolution.kernel}{reasons}")
        fell_back = fell_back or resolution.fell_back
    detail = f"auto on NPU tensors {', '.join(parts)}"
    if fell_back and accelerator == "npu":
        cause = "no Ascend kernel can take the call (the reasons above)"
        fix = (
            "install or upgrade the package named, or set this operator's kernel to "
            "reference to silence the warning"
        )
        return Check(label, WARN, detail, cause, fix)
    return Check(label, OK, detail)


def _quiet_optional(name: str):
    """``_optional.import_optional(name)`` with the import's own warnings hidden."""
    optional = importlib.import_module("mcore_npu._optional")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return optional.import_optional(name)


def check_mla_value(probe: _Probe) -> Check:
    """Which path multi-latent attention's smaller value head (Dv < D) takes with
    ``mla_value_padding: auto`` here: one probe call of the installed operator on the NPU
    (``mcore_npu.ops.value_padding``), or the reference off-NPU."""
    if probe.torch is None:
        return _not_checked("mla value")
    padding = importlib.import_module("mcore_npu.ops.value_padding")
    accelerator = probe.accelerator or accelerators.current_accelerator()
    if accelerator != "npu":
        detail = "Dv < D unpadded: the reference kernel takes it in every layout"
        return Check("mla value", OK, f"{detail} (mla_value_padding auto; on pads anyway)")
    op = importlib.import_module("mcore_npu.ops.registry").ascend("fusion_attention")
    if padding.takes_smaller_value(op, "npu"):
        detail = "Dv < D unpadded: npu_fusion_attention returns Dv-wide outputs"
        return Check("mla value", OK, f"{detail} (probe on the NPU; mla_value_padding auto)")
    detail = "Dv < D padded: v padded to D and the output sliced (mla_value_padding auto)"
    cause = (
        "this torch_npu does not return a Dv-wide output for Dv < D (probe on the NPU); the "
        "padding costs (D - Dv) / Dv more value memory"
    )
    fix = (
        "a torch-npu / CANN release with Dv < D (MindSpeed-LLM recommends CANN >= 8.2.RC1 for "
        "it); the results are the same either way"
    )
    return Check("mla value", WARN, detail, cause, fix)


# The report's lines, in order. Each takes the shared probe and returns one Check.
CHECKS: tuple[tuple[str, Callable[[_Probe], Check]], ...] = (
    ("python", check_python),
    ("torch", check_torch),
    ("megatron-core", check_megatron),
    ("torch-npu", check_torch_npu),
    ("cann", check_cann),
    ("transformer-engine", check_transformer_engine),
    ("accelerator", check_accelerator),
    ("allocator env", check_allocator_env),
    ("allocator setter", check_allocator_setter),
    ("attention", check_attention),
    ("mla value", check_mla_value),
    *((f"op {name}", functools.partial(check_operator, name)) for name in OPERATOR_NAMES),
)


def gather_checks() -> list[Check]:
    """Run every check; an exception inside one becomes an ``error`` line, never a crash."""
    probe = _probe_torch()
    checks = []
    for name, check in CHECKS:
        try:
            checks.append(check(probe))
        except Exception as exc:
            detail = f"doctor could not check this: {_describe(exc)}"
            fix = "please report it with this output"
            checks.append(Check(name, ERROR, detail, "an unexpected environment", fix))
    return checks


def summary(checks: list[Check]) -> str:
    """One line: ``"healthy (2 warnings)"`` or ``"1 error: torch-npu: <cause>"``."""
    errors = [c for c in checks if c.status == ERROR]
    warns = sum(c.status == WARN for c in checks)
    if not errors:
        return "healthy" + (f" ({warns} warning{'s' * (warns != 1)})" if warns else "")
    listed = "; ".join(f"{c.name}: {c.cause or c.detail}" for c in errors)
    return f"{len(errors)} error{'s' * (len(errors) != 1)}: {listed}"


def format_text(checks: list[Check]) -> str:
    """Aligned ``name: value`` lines; problems marked WARN / ERROR with cause and fix below."""
    width = max(len(c.name) for c in checks) + 2
    lines = []
    for c in checks:
        marker = "" if c.status == OK else f"{c.status.upper()} "
        lines.append(f"{c.name + ':':<{width}}{marker}{c.detail}")
        if c.cause:
            lines.append(f"{'':<{width}}cause: {c.cause}")
        if c.fix:
            lines.append(f"{'':<{width}}fix: {c.fix}")
    lines.append(f"{'summary:':<{width}}{summary(checks)}")
    return "\n".join(lines)


def format_json(checks: list[Check]) -> str:
    healthy = not any(c.status == ERROR for c in checks)
    report = {"healthy": healthy, "summary": summary(checks), "checks": [asdict(c) for c in checks]}
    return json.dumps(report, indent=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")


def run(args: argparse.Namespace) -> int:
    """Print the report; exit 0 when nothing is an error, else 1 with a summary on stderr."""
    if args.json:  # keep stdout pure JSON even if an import prints something
        with contextlib.redirect_stdout(sys.stderr):
            checks = gather_checks()
        print(format_json(checks), flush=True)
    else:
        checks = gather_checks()
        print(format_text(checks), flush=True)
    if any(c.status == ERROR for c in checks):
        print(f"mcore-npu doctor: {summary(checks)}", file=sys.stderr, flush=True)
        return 1
    return 0
