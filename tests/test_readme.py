"""The README stays true: its two commands, and figures that match the saved bench results."""

from __future__ import annotations

from pathlib import Path

from mcore_npu.tools.bench import readme

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mcore_npu"


def test_readme_benchmark_section_matches_the_saved_results():
    text = (ROOT / "README.md").read_text()
    assert readme.splice(text, readme.render(ROOT / "docs" / "bench")) == text, (
        "README.md is out of date with docs/bench/*.json: run python -m mcore_npu.tools.bench.readme"
    )


def test_readme_starts_with_the_two_commands():
    head = (ROOT / "README.md").read_text()[:1500]
    assert "make demo" in head and "make test" in head


def test_ci_runs_only_what_the_readme_shows():
    ci = (ROOT / ".ci" / "run").read_text()
    text = (ROOT / "README.md").read_text()
    # the make targets CI calls (redirections and `&` aside), in order; the verl environment is
    # built while `make test` runs
    commands = [" ".join(line.split()[:2]) for line in ci.splitlines() if line.startswith("make ")]
    assert commands == ["make lint", "make verl-env", "make test", "make test-verl"]
    assert all(f"`{command}`" in text for command in commands)


def _layout_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("## Repository layout") :]


def test_readme_layout_names_every_room_and_test_folder():
    layout = _layout_section()
    rooms = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert rooms and all(f"{room}/" in layout for room in rooms), rooms
    root_modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert all(name in layout for name in root_modules), root_modules
    test_folders = sorted(p.parent.name for p in (ROOT / "tests").glob("*/__init__.py"))
    assert all(f"{folder}/" in layout for folder in test_folders), test_folders


def test_tests_mirror_the_package_rooms():
    rooms = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    test_folders = {p.parent.name for p in (ROOT / "tests").glob("*/__init__.py")}
    # every room with code has its test folder (integrations: its tests need their own env)
    assert rooms - {"integrations"} <= test_folders, rooms - test_folders
