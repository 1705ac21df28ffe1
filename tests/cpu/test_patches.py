"""The CPU runtime's table is what it does: ``apply()`` replaces exactly the attributes of
``mcore_npu.cpu.PATCHES`` (every attribute of every loaded torch and Megatron module and of
their classes is compared, in a fresh process) and enters its one torch function mode;
``revert()`` gives every attribute back as the same object and leaves no mode."""

from __future__ import annotations

import json
import sys

from mcore_npu.cpu import FUNCTION_MODE, PATCHES
from tests.launch import ROOT, run_command

SCRIPT = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
from torch.overrides import _get_current_function_mode_stack as modes
from mcore_npu.cpu import PATCHES, apply, revert
from tests.patch_audit import snapshot, replaced
for patch in PATCHES:
    patch.owner()  # every module the table names is loaded before the first snapshot
before = snapshot(("torch", "megatron"))
apply()
during, modes_during = snapshot(("torch", "megatron")), [type(m).__name__ for m in modes()]
revert()
after, modes_after = snapshot(("torch", "megatron")), [type(m).__name__ for m in modes()]
print(json.dumps({{"changed": replaced(before, during), "restored": replaced(before, after),
                  "modes_during": modes_during, "modes_after": modes_after,
                  "entries": len(before)}}))
"""


def test_apply_replaces_exactly_the_table_and_revert_restores_every_object():
    done = run_command([sys.executable, "-c", SCRIPT], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    table = sorted(f"{patch.module}:{patch.attribute}" for patch in PATCHES)
    print(f"{report['entries']} attributes compared; {len(table)} replaced, as the table says")
    assert report["changed"] == table
    assert report["restored"] == []
    assert report["modes_during"] == [FUNCTION_MODE[0].__name__] and report["modes_after"] == []


def test_every_entry_gives_its_reason_and_how():
    for patch in PATCHES:
        assert patch.how in ("value", "wrap", "new") and len(patch.reason) > 10, patch
    assert len({(p.module, p.attribute) for p in PATCHES}) == len(PATCHES)


def test_the_docs_list_every_entry_with_its_reason():
    """docs/architecture.md's table of the CPU runtime is the table itself."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    for patch in PATCHES:
        row = f"| `{patch.module}` | `{patch.attribute}` | {patch.how} | {patch.reason} |"
        assert row in text, row
    assert f"changes exactly these {len(PATCHES)}" in text
