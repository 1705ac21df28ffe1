"""The ``verl.plugins`` entry point: loading it registers the NPU Megatron engines.

``pyproject.toml`` declares ``mcore_npu = "mcore_npu.integrations.verl.plugin:registered"``;
verl 0.9.x loads every entry point of that group at the end of ``import verl`` (in every process),
unless ``VERL_USE_EXTERNAL_PLUGINS`` says otherwise (``none``, or a lower-case list of names).

Cheap and harmless where it does not apply: no torch_npu import; the engines are registered under
``("npu", "huawei")`` only; without megatron-core nothing is registered; a failure is logged as a
warning. The engines (and Megatron) are imported only when verl's engine registry
(``verl.workers.engine``) is: a one-shot import hook (:class:`_AfterImport`) registers them right
after it. If the engine module itself imported verl (and so this plugin), it registers itself at
its end (:data:`deferred`). See docs/verl.md.
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
    """Register the NPU engines with verl's ``EngineRegistry``; the classes registered, or ``()``
    (the reason logged) without megatron-core or when the engines do not import."""
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
    """Runs ``then()`` once, right after the module ``name`` has been executed (the module is
    found and loaded by the finders after this one)."""

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
