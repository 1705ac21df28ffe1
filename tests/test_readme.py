"""The README stays true: its two commands, and figures that match the saved bench results."""

from __future__ import annotations

from pathlib import Path

from mcore_npu.tools.bench import readme

ROOT = Path(__file__).resolve().parent.parent


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
    commands = [line.strip() for line in ci.splitlines() if line.startswith("make ")]
    assert commands == ["make lint", "make test", "make test-verl"]
    assert all(command in text for command in commands)
