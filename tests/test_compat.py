"""The megatron-core range ``pyproject.toml`` declares is the range docs/compat.md shows measured.

Every minor line (0.15, 0.16, ...) the declared range admits must have a row in the table of
docs/compat.md, every row must be admitted, and ``make test-compat`` (scripts/compat_matrix.py)
must check exactly the versions of the table. Widening the range without a measured row fails.
"""

from __future__ import annotations

import re

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

from scripts.compat_matrix import ROOT, VERSIONS

TABLE_ROW = re.compile(r"^\|\s*(\d+\.\d+\.\d+)\s*\|", re.MULTILINE)


def declared_specifier():
    """The ``megatron-core`` specifier of pyproject's ``dependencies``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        requirement = Requirement(line)
        if requirement.name == "megatron-core":
            return requirement.specifier
    raise AssertionError("pyproject.toml declares no megatron-core dependency")


def table_versions() -> list[Version]:
    """The versions in the first column of docs/compat.md's table."""
    return [Version(v) for v in TABLE_ROW.findall((ROOT / "docs" / "compat.md").read_text())]


def admitted_minor_lines(specifier, majors=range(3), minors=range(100)) -> set[tuple[int, int]]:
    """Each ``(major, minor)`` of which some release the specifier admits (probing x.y.0 ... x.y.99)."""
    return {
        (major, minor)
        for major in majors
        for minor in minors
        if any(Version(f"{major}.{minor}.{patch}") in specifier for patch in range(100))
    }


def test_every_admitted_minor_line_is_measured():
    specifier = declared_specifier()
    listed = {(v.major, v.minor) for v in table_versions()}
    missing = sorted(admitted_minor_lines(specifier) - listed)
    assert not missing, (
        f"pyproject.toml admits megatron-core{specifier}, but docs/compat.md has no measured row "
        f"for {', '.join(f'{a}.{b}' for a, b in missing)}: run `make test-compat` with that "
        "version in scripts/compat_matrix.py VERSIONS and add its row, or narrow the range"
    )


def test_every_row_is_admitted_and_checked():
    specifier = declared_specifier()
    rows = table_versions()
    assert rows, "docs/compat.md has no version table"
    assert all(v in specifier for v in rows), (rows, str(specifier))
    assert sorted(rows) == sorted(Version(v) for v in VERSIONS)


def test_the_check_catches_a_wider_range():
    """The probe itself: a range reaching 0.20 admits a line the table lacks."""
    from packaging.specifiers import SpecifierSet

    listed = {(v.major, v.minor) for v in table_versions()}
    assert admitted_minor_lines(SpecifierSet(">=0.15,<0.21")) - listed == {(0, 20)}
    assert admitted_minor_lines(SpecifierSet(">=0.14")) - listed >= {(0, 14), (1, 0)}


def _table_rows() -> dict[str, list[str]]:
    """docs/compat.md's measured rows: version -> its cells after the version."""
    rows = {}
    for line in (ROOT / "docs" / "compat.md").read_text().splitlines():
        found = TABLE_ROW.match(line)
        if found:
            rows[found.group(1)] = [cell.strip() for cell in line.strip("|").split("|")[1:]]
    return rows


def test_the_readme_states_the_table_as_measured():
    """README's compatibility sentence: the test count, the zero failures and errors, and 0.15.3's
    skips are those of docs/compat.md's table."""
    rows = _table_rows()
    readme = " ".join((ROOT / "README.md").read_text().split())
    totals = {int(c[0]) + int(c[1]) + int(c[2]) + int(c[3]) for c in rows.values()}
    assert len(totals) == 1, totals  # every version ran the same tests
    assert f"trainer tests, {totals.pop():,}, on megatron-core" in readme
    clean = all(c[1] == "0" and c[3] == "0" for c in rows.values())
    assert ("measured 0 failed and 0 errors on all five" in readme) == clean
    assert f"0.15.3 skips {rows['0.15.3'][2]} of them" in readme


def test_the_printed_table_has_the_columns_of_the_docs_table():
    """``make test-compat`` prints rows docs/compat.md can take as they are: the same header, and a
    row per version with its counts, seconds, when it ran and the commit."""
    from scripts.compat_matrix import parse_summary, table

    counts = parse_summary("....\n3 failed, 120 passed, 2 skipped, 1 error in 9.1s\n")
    assert counts == {"passed": 120, "failed": 3, "skipped": 2, "errors": 1}
    assert parse_summary("Killed\n") is None
    printed = table([("0.15.3", counts, 441.4, "08:30-08:38"), ("0.19.2", None, 12.0, "08:38-08:39")],
                    "6e15b1b").splitlines()  # fmt: skip
    docs = (ROOT / "docs" / "compat.md").read_text().splitlines()
    header = next(i for i, line in enumerate(docs) if line.startswith("| megatron-core |"))
    assert printed[:2] == docs[header : header + 2]
    assert printed[2] == "| 0.15.3 | 120 | 3 | 2 | 1 | 441 | 08:30-08:38 | 6e15b1b |"
    assert printed[3].startswith("| 0.19.2 | no pytest summary") and printed[3].endswith(
        "| 12 | 08:38-08:39 | 6e15b1b |"
    )
    assert all(line.count("|") == printed[0].count("|") for line in printed)
