"""The ``verl.plugins`` entry point: loading it registers the NPU Megatron engines.

verl 0.9.x imports every entry point of the ``verl.plugins`` group at the end of
``verl/__init__.py`` and calls ``EntryPoint.load()`` on it (the loaded attribute is not called).
``pyproject.toml`` declares::

    [project.entry-points."verl.plugins"]
    mcore_npu = "mcore_npu.integrations.verl.plugin:registered"

so importing this module is what registers the engines. verl decides whether it is loaded:
``VERL_USE_EXTERNAL_PLUGINS`` = ``auto`` (default: every entry point), ``none`` (no entry
point), or a comma-separated list of entry-point names (``mcore_npu`` loads this one). verl
lower-cases the list, so the entry point's name is lower case.

Harmless where it does not apply:

- nothing here imports torch_npu; the engines are registered under ``("npu", "huawei")`` only,
  a key verl looks up on Ascend machines (or when ``VERL_ENGINE_DEVICE=npu`` and
  ``VERL_ENGINE_VENDOR=huawei`` are exported), so CUDA and CPU runs pick the same engines as
  before;
- without megatron-core nothing is registered (``registered`` is an empty tuple);
- a failure while registering is logged as a warning (verl itself would only log it at debug
  level) and leaves verl's registry as it was;
- imported before verl, ``mcore_npu.integrations.verl.engine`` imports verl, which loads this
  plugin while the engine module is half built: the plugin then leaves the registration to the
  engine module's last line (``registered`` stays empty, the engines are registered all the same);
- cheap where no engine is built: verl loads plugins in every process that imports it (Ray's
  agent-loop, reward and rollout actors too), and the engines import Megatron (about 3 s of CPU).
  So the plugin registers them when verl's engine registry, ``verl.workers.engine``, is imported
  (at once if it already is): a one-shot import hook (:class:`_AfterImport`) runs
  :func:`register` right after that package's body, before anyone can look an engine up, then
  removes itself. ``registered`` is then empty; ``EngineRegistry`` holds the engines all the same.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys

logger = logging.getLogger(__name__)

__all__ = ["register", "registered"]

_ENGINE = "mcore_npu.integrations.verl.engine"
# True when verl loaded this plugin while ``engine`` itself was importing verl (user code imported
# the engine module before verl): that half-built module registers itself when its body ends.
deferred = False


def register() -> tuple[type, ...]:
    """Register the NPU engines with verl's ``EngineRegistry``; return the classes registered.

    Returns an empty tuple (and registers nothing) when megatron-core is not installed or the
    engines cannot be imported; the reason is logged as a warning.
    """
    if importlib.util.find_spec("megatron") is None:
        logger.info("mcore_npu verl plugin: megatron-core is not installed; nothing registered")
        return ()
    half_built = sys.modules.get(_ENGINE)
    if half_built is not None and not hasattr(half_built, "register"):
        global deferred
        deferred = True  # the engine module is importing verl right now; it registers at its end
        return ()
    try:
        from mcore_npu.integrations.verl import engine
    except Exception as exc:  # verl would swallow it at debug level; say it louder
        logger.warning("mcore_npu verl plugin: NPU Megatron engine not registered: %r", exc)
        return ()
    return engine.register()


_REGISTRY = "verl.workers.engine"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then()`` right after the module ``name`` has been executed, once; nothing else is
    changed: the module is found and loaded by the finders after this one."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenLoader(spec.loader, self.then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    """``loader`` with ``then()`` after ``exec_module``; the module is left with ``loader`` as
    its ``__loader__`` and ``__spec__.loader``, as if this one had never been there."""

    def __init__(self, loader, then) -> None:
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self.loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.then()

    def __getattr__(self, name):  # is_package, get_code, get_resource_reader, ...
        return getattr(self.loader, name)


def _register_with_the_registry() -> tuple[type, ...]:
    """:func:`register` now if verl's engine registry is imported, else right after it is."""
    if _REGISTRY in sys.modules:
        return register()
    sys.meta_path.insert(0, _AfterImport(_REGISTRY, register))
    return ()


registered: tuple[type, ...] = _register_with_the_registry()
