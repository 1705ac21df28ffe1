"""The README and the docs pages stay true: the README's two commands and links, its headline
figures and the figures page against the saved bench results, the architecture page against the
package, and the docs site's nav against the pages (the strict `make docs` build checks links)."""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import yaml

from mcore_npu.tools.bench import readme

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mcore_npu"
DOCS = ROOT / "docs"
BENCH = DOCS / "bench"
# pages other helpers are writing; the lead fills them (each a title and one line until then)
PLACEHOLDERS: set[str] = set()  # pages still to be written (none)


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_figures_page_benchmark_section_matches_the_saved_results():
    text = (DOCS / "figures.md").read_text()
    assert readme.splice(text, readme.render(BENCH)) == text, (
        "docs/figures.md is out of date with docs/bench/*.json: "
        "run python -m mcore_npu.tools.bench.readme"
    )


def test_bench_tool_fills_a_page_and_checks_it(tmp_path):
    page = tmp_path / "figures.md"
    page.write_text(f"# Figures\n\n{readme.BEGIN}\nstale\n{readme.END}\n")
    assert readme.main(["--page", str(page), "--results", str(BENCH)]) == 0
    text = page.read_text()
    assert "stale" not in text and "![mask](bench/mask.png)" in text
    assert readme.main(["--page", str(page), "--results", str(BENCH), "--check"]) == 0


def test_readme_starts_with_the_two_commands():
    head = _readme()[:1500]
    assert "make demo" in head and "make test" in head


def test_readme_stays_short():
    assert len(_readme().splitlines()) < 300


def test_readme_links_resolve_to_files():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _readme())
    assert targets, "the README links its docs pages"
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert not missing, missing


def test_every_docs_page_is_reached_from_the_readme_or_the_docs_home():
    text, home = _readme(), (DOCS / "index.md").read_text()
    assert "(docs/index.md)" in text
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    unlinked = [page for page in pages if f"(docs/{page})" not in text and f"({page})" not in home]
    assert not unlinked, unlinked


def test_ci_runs_only_what_the_readme_shows():
    ci = (ROOT / ".ci" / "run").read_text()
    text = _readme()
    # the make targets CI calls (redirections, `&` and `{ ...; }` aside), in order; the verl and
    # smoke environments and the docs site are built while `make test` runs
    lines = [line.lstrip("{ ") for line in ci.splitlines()]
    commands = [" ".join(line.split()[:2]) for line in lines if line.startswith("make ")]
    assert commands == [
        "make lint", "make verl-env", "make docs", "make test", "make test-verl",
        "make test-nemotron", "make compat-smoke",
    ]  # fmt: skip
    assert all(f"`{command}`" in text for command in commands)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _headline(label: str) -> str:
    rows = [line for line in _readme().splitlines() if line.startswith(f"| {label}")]
    assert len(rows) == 1, label
    return rows[0]


def test_readme_headline_figures_match_the_saved_results():
    mask = json.loads((BENCH / "mask.json").read_text())
    by = {(r["S"], r["B"], r["method"]): r for r in mask["rows"]}
    row = _headline("mask bytes per micro-batch")
    assert "S=16384, B=4" in row
    assert _mib(by[16384, 4, "verl after PR 7055"]["peak_bytes"]) in row
    assert _mib(by[16384, 4, "plugin causal (per step)"]["peak_bytes"]) in row
    assert _mib(next(iter(mask["one_time_bytes"].values()))) in row

    attention = json.loads((BENCH / "attention.json").read_text())
    peak = {r["method"]: r["peak_bytes"] for r in attention["rows"] if r["S"] == 2048}
    ratio = next(r for r in attention["ratios"] if r["S"] == 2048)["reference_peak_over_dpa"]
    row = _headline("attention forward peak")
    assert "S=2048" in row and _mib(peak["Megatron DPA"]) in row
    assert _mib(peak["reference (SBH)"]) in row and f"({ratio:.4f}×)" in row

    step = json.loads((BENCH / "step.json").read_text())["rows"][-1]
    row = _headline("one training step")
    assert f"S={step['seq_length']}" in row
    assert f"{step['time_ratio']:.2f}× time, {step['peak_ratio']:.2f}× peak" in row

    for name, label in (("gdn", "Gated DeltaNet rule"), ("ssd", "Mamba2 scan")):
        goals = json.loads((BENCH / f"{name}.json").read_text())["goals"]
        time, peak = (g["measured"] for g in goals)
        assert f"{time:.2f}× time" in _headline(label) and f"({peak:.2f}×)" in _headline(label)

    dsa = json.loads((BENCH / "dsa.json").read_text())
    peak = {r["method"]: r["peak_bytes"] for r in dsa["rows"]}
    row = _headline("DeepSeek sparse attention")
    assert f"{dsa['time_ratio']:.2f}× time" in row and f"({dsa['peak_ratio']:.3f}×)" in row
    assert _mib(peak["dense masked"]) in row and _mib(peak["reference"]) in row

    cp = json.loads((BENCH / "cp.json").read_text())
    ring = next(r for r in cp["rows"] if r["cp"] == 2 and r["comm"] == "p2p")
    row = _headline("context parallelism")
    assert f"S={ring['S']}" in row
    assert f"{ring['forward']['resident_peak_over_cp1']:.3f}×" in row


def _layout_section() -> str:
    text = (DOCS / "architecture.md").read_text()
    return text[text.index("## Repository layout") :]


def test_architecture_page_names_every_room_and_test_folder():
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


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return [page for item in node for page in _nav_pages(item)]


def test_docs_site_is_strict_and_its_nav_lists_every_page_once():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["strict"] is True and config["docs_dir"] == "docs"
    assert all(config["validation"][key] == "warn" for key in ("omitted_files", "anchors"))
    nav = _nav_pages(config["nav"])
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(nav) == pages, set(nav) ^ set(pages)


def test_every_docs_page_starts_with_a_table_of_contents():
    for page in sorted(DOCS.glob("*.md")):
        if page.name in PLACEHOLDERS:
            continue
        text = page.read_text()
        head = text[: text.index("\n## ")] if "\n## " in text else text
        sections = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
        assert sections, page.name
        assert f"](#{_slug(sections[0])})" in head, f"{page.name}: no table of contents first"


def _slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def test_main_ppo_page_states_the_tests_own_tolerance_and_step_counts():
    """docs/verl_main_ppo.md quotes the sync tolerance and the step counts of
    tests/integrations/test_main_ppo.py (read from its source: this environment has no verl)."""
    source = (ROOT / "tests" / "integrations" / "test_main_ppo.py").read_text()
    constants = dict(
        re.findall(r"^(SYNC_TOLERANCE|LEARNING_STEPS|STEPS) = ([\d.]+)$", source, re.M)
    )
    page = (DOCS / "verl_main_ppo.md").read_text()
    assert f"the tolerance is {constants['SYNC_TOLERANCE']}" in page
    assert f"{constants['STEPS']} steps, a checkpoint at step 2" in page
    assert f"{constants['LEARNING_STEPS']} steps, `lr=2e-3`" in page
