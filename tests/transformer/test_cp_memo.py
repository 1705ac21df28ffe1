"""Context parallelism's index tensors have an owner: the layer's ``SeqLengthsMemo``.

- Each packed layout (ring blocks, the all-gather index, the Ulysses token order) is built once
  per memo and key, and again for a new layout; at most ``capacity`` layouts are kept.
- They die with the memo (no module-level cache keeps a device tensor alive).
- No module of the context-parallel rooms keeps a module-level ``functools`` cache.
"""

from __future__ import annotations

import ast
import gc
import weakref
from pathlib import Path

import mcore_npu
from mcore_npu.masks import SeqLengthsMemo
from mcore_npu.transformer.context_parallel import all_gather, blocks, ulysses

PACKAGE = Path(mcore_npu.__file__).resolve().parent
ENDS, OTHER = (4, 10, 12, 20), (6, 10)


def _builders(memo):
    return {
        "ring": lambda ends: blocks.PackedLayout(ends, 2, "cpu", memo).plan["early"],
        "all_gather": lambda ends: all_gather.thd_layout(ends, 2, 0, True, None, "cpu", memo)[0],
        "a2a": lambda ends: ulysses.TokenOrder(2, "cpu", ends, memo).natural,
    }


def test_each_layout_is_built_once_per_memo_and_key():
    memo = SeqLengthsMemo()
    for name, build in _builders(memo).items():
        before = memo.plans_built
        first = build(ENDS)
        assert build(ENDS) is first, name  # every layer of the step shares it
        assert memo.plans_built == before + 1, name
        assert build(OTHER) is not first and memo.plans_built == before + 2, name
    fresh = SeqLengthsMemo()
    assert _builders(fresh)["ring"](ENDS) is not _builders(memo)["ring"](ENDS)


def test_the_memo_keeps_at_most_capacity_layouts():
    memo = SeqLengthsMemo(capacity=2)
    build = _builders(memo)["a2a"]
    first = build(ENDS)
    build(OTHER), build((8,))
    assert build(ENDS) is not first and memo.plans_built == 4


def test_index_tensors_die_with_their_memo():
    memo = SeqLengthsMemo()
    alive = [weakref.ref(build(ENDS)) for build in _builders(memo).values()]
    assert all(ref() is not None for ref in alive)
    del memo
    gc.collect()
    assert [ref() for ref in alive] == [None, None, None]


def test_no_module_level_cache_in_the_context_parallel_rooms():
    found = []
    for room in ("transformer/context_parallel", "transformer/gated_delta_net"):
        for path in sorted((PACKAGE / room).glob("*.py")):
            for node in ast.parse(path.read_text()).body:
                decorators = getattr(node, "decorator_list", [])
                names = [ast.unparse(d) for d in decorators]
                found += [f"{path.name}:{node.lineno} {n}" for n in names if "cache" in n]
    assert found == []
