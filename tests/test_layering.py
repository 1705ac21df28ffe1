"""Imports flow one way: entry points -> tools | integrations -> training -> transformer |
optimizer -> masks -> ops | allocator. Every module's imports are read with ``ast`` (nothing is imported to check).

A module may import its own room or any room of a lower rank, nothing else: no import goes up a
rank or sideways to a different room of the same rank (``tools`` and ``integrations`` do not know
each other; ``ops`` and ``allocator`` neither). What counts as an import:

- ``import mcore_npu.x.y`` / ``from mcore_npu.x import y`` / relative imports, at any depth
  (imports inside functions count: they are the lazy imports this package uses everywhere);
- ``from mcore_npu import name``: the room of the module that the package's lazy export of
  ``name`` points to (``mcore_npu._EXPORTS``), or the bottom room for ``__version__``;
- a string constant that is exactly a module path of the package (``importlib.import_module``).

The checker is tested on synthetic module trees, bad and good, so that it can be seen to fail.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

import mcore_npu
from tests.launch import run_command

PACKAGE = Path(mcore_npu.__file__).resolve().parent

# room -> rank, bottom up
RANKS = {
    "base": 0,  # _warnings: warn-once helpers; and the package's constants (__version__)
    "ops": 1,
    "allocator": 1,
    "masks": 2,
    "cpu": 2,  # the CPU runtime: torch, Megatron and the allocator's detection only
    "transformer": 3,
    "optimizer": 3,  # peers: the layer specs and the optimizer do not know each other
    "training": 4,
    "tools": 5,
    "integrations": 5,
    "entry": 6,  # cli, __main__, the train launcher, the package facade
}
BASE_MODULES = {"_warnings", "_optional"}  # warn-once; the one importer of the Ascend packages


def room_of(module: str) -> str:
    """``mcore_npu.transformer.attention`` -> ``transformer``; root modules -> base or entry."""
    parts = module.split(".")
    if len(parts) == 1:
        return "entry"  # mcore_npu/__init__.py: the lazy facade over everything
    if parts[1] in RANKS:
        return parts[1]
    return "base" if parts[1] in BASE_MODULES else "entry"


def imported_modules(module: str, source: str, is_package: bool, exports: dict) -> set[str]:
    """Every mcore_npu module that ``source`` (the text of ``module``) imports, in any form."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                if base == "mcore_npu":
                    found.add(exports.get(alias.name, f"mcore_npu.{alias.name}"))
                else:
                    found.add(base)
        elif isinstance(node, ast.Constant) and _is_module_path(node.value):
            found.add(node.value)
    return {name for name in found if name.split(".")[0] == "mcore_npu"}


def _is_module_path(value) -> bool:
    parts = value.split(".") if isinstance(value, str) else []
    return len(parts) > 1 and parts[0] == "mcore_npu" and all(p.isidentifier() for p in parts)


def violations(tree: dict[str, tuple[str, bool]], exports: dict) -> list[str]:
    """``{module: (source, is_package)}`` -> one line per import that goes up or sideways."""
    problems = []
    for module, (source, is_package) in sorted(tree.items()):
        mine = room_of(module)
        for target in sorted(imported_modules(module, source, is_package, exports)):
            if target == "mcore_npu.__version__":
                continue
            theirs = room_of(target)
            if theirs != mine and RANKS[theirs] >= RANKS[mine]:
                problems.append(f"{module} ({mine}) imports {target} ({theirs})")
    return problems


def package_tree() -> dict[str, tuple[str, bool]]:
    tree = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).with_suffix("")
        is_package = relative.name == "__init__"
        parts = (
            ["mcore_npu", *relative.parts[:-1]] if is_package else ["mcore_npu", *relative.parts]
        )
        tree[".".join(parts)] = (path.read_text(encoding="utf-8"), is_package)
    return tree


def test_the_package_imports_flow_one_way():
    tree = package_tree()
    assert len(tree) > 40 and "mcore_npu.transformer.attention" in tree
    assert violations(tree, mcore_npu._EXPORTS) == []


def test_every_module_lives_in_a_known_room():
    rooms = {room_of(module) for module in package_tree()}
    assert rooms <= set(RANKS), rooms
    assert {"ops", "masks", "transformer", "allocator", "training", "tools"} <= rooms


BAD = {
    "plugin imports the trainer": (
        "mcore_npu.transformer.layer_specs", "from mcore_npu.training import config"),
    "ops import masks (up)": ("mcore_npu.ops.reference", "import mcore_npu.masks.compressed"),
    "relative import upwards": ("mcore_npu.masks.dense", "from ..transformer import attention"),
    "lazy import inside a function": (
        "mcore_npu.masks.packing", "def f():\n    from mcore_npu.tools import verify\n"),
    "importlib with a module path": (
        "mcore_npu.ops.validation", "import importlib\nimportlib.import_module('mcore_npu.tools.doctor')"),
    "a lazy export that lives higher": ("mcore_npu.masks.seqlens", "from mcore_npu import build_model"),
    "sideways at the same rank": ("mcore_npu.tools.doctor", "from mcore_npu.integrations import verl"),
    "ops and allocator are peers": ("mcore_npu.ops.reference", "from mcore_npu.allocator import device"),
}  # fmt: skip
GOOD = {
    "down a rank": ("mcore_npu.transformer.attention", "from mcore_npu.masks import describe_mask"),
    "own room, relative": ("mcore_npu.masks.dense", "from .seqlens import SeqLengths"),
    "the version constant": ("mcore_npu.ops.reference", "from mcore_npu import __version__"),
    "entry point anywhere": ("mcore_npu.cli", "import importlib\nimportlib.import_module('mcore_npu.tools.doctor')"),
    "not a module path": ("mcore_npu.ops.reference", "x = 'call mcore_npu.training.runtime.shutdown() first'"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_checker_catches_an_upward_import(case):
    module, source = BAD[case]
    found = violations({module: (source, False)}, mcore_npu._EXPORTS)
    assert len(found) == 1 and found[0].startswith(module), found


@pytest.mark.parametrize("case", sorted(GOOD))
def test_the_checker_allows_downward_imports(case):
    module, source = GOOD[case]
    assert violations({module: (source, False)}, mcore_npu._EXPORTS) == []


ROOM_PROBE = """
import importlib, json, sys
rooms = ["mcore_npu", "mcore_npu.ops", "mcore_npu.masks", "mcore_npu.allocator",
         "mcore_npu.transformer", "mcore_npu.training", "mcore_npu.tools", "mcore_npu.integrations",
         "mcore_npu.integrations.verl"]
for room in rooms:
    importlib.import_module(room)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"megatron", "torch_npu",
                                                                   "transformer_engine", "verl"})))
"""


def test_no_room_imports_megatron_when_the_room_is_imported():
    heavy = json.loads(run_command([sys.executable, "-c", ROOM_PROBE], check=True).stdout)
    assert heavy == []


def import_graph(tree: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the package's modules its ``import`` statements name (at any depth, so the
    imports inside functions count): ``from a.b import c`` names ``a.b.c`` when that is a
    module, else ``a.b``. Module paths in strings are data here (the operator registry names
    functions it resolves when asked)."""
    graph = {}
    for module, (source, is_package) in tree.items():
        package = module if is_package else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in tree else base)
        graph[module] = {name for name in found if name in tree and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_files_import_each_other_even_through_others():
    assert cycles(import_graph(package_tree())) == []


def test_the_cycle_check_finds_a_cycle_through_a_lazy_import():
    tree = {
        "mcore_npu.ops.a": ("from mcore_npu.ops import b\n", False),
        "mcore_npu.ops.b": ("def f():\n    from mcore_npu.ops.c import g\n", False),
        "mcore_npu.ops.c": ("from . import a\n", False),
        "mcore_npu.ops.d": ("from mcore_npu.ops import a\n", False),
    }
    assert cycles(import_graph(tree)) == [["mcore_npu.ops.a", "mcore_npu.ops.b", "mcore_npu.ops.c"]]
