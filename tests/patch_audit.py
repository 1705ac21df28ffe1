"""Snapshots of what other packages' modules hold, to tell whether anything was replaced.

``snapshot(prefixes)`` records, for every loaded module whose name starts with one of
``prefixes``, each module attribute and each attribute of each class the module defines, as the
objects themselves (kept alive, so identity is meaningful). ``replaced(before, after)`` lists
the entries present in both that are no longer the same object; with ``callables_only`` only
functions, classes and methods count (Megatron's own globals, such as its process groups, are
state its code assigns, not replacements).
"""

from __future__ import annotations

import inspect
import sys

PREFIXES = ("torch", "megatron", "verl", "mbridge", "transformers")


def _entries(module):
    name = module.__name__
    try:
        items = list(vars(module).items())
    except TypeError:
        return
    for attribute, value in items:
        yield (name, attribute), value
        if isinstance(value, type) and getattr(value, "__module__", None) == name:
            for key, member in list(vars(value).items()):
                yield (name, f"{value.__qualname__}.{key}"), member


def snapshot(prefixes=PREFIXES) -> dict:
    """``{(module, attribute): object}`` of the loaded modules under ``prefixes``."""
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        if name.split(".")[0] not in prefixes:
            continue
        for key, value in _entries(module):
            found[key] = value
    return found


def _is_code(value) -> bool:
    return (inspect.isfunction(value) or inspect.isclass(value) or inspect.ismethod(value)
            or inspect.isbuiltin(value) or isinstance(value, (staticmethod, classmethod)))  # fmt: skip


def replaced(before: dict, after: dict, *, callables_only: bool = False) -> list[str]:
    """``module:attribute`` of every entry of ``before`` that ``after`` holds as another object
    (or no longer holds)."""
    out, modules = [], {module for module, _ in after}
    for key, value in before.items():
        if key not in after:
            if key[0] in modules:  # the module is still there: the entry went
                out.append(f"{key[0]}:{key[1]} (removed)")
            continue
        if after[key] is value:
            continue
        if callables_only and not _is_code(value):
            continue
        out.append(f"{key[0]}:{key[1]}")
    return sorted(out)
