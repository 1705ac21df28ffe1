"""``make test-compat``: the operator, mask, transformer and trainer tests on every megatron-core
version ``pyproject.toml`` admits, one virtual environment per version under ``.compat/<version>``.

Each environment installs ``requirements.lock`` (torch 2.13.0 CPU, the locked megatron-core), then
replaces megatron-core by the version under test with ``--no-deps --ignore-requires-python`` (the
0.17+ wheels declare Python >= 3.12; they install and run on 3.11), then this package with
``--no-deps`` (plus triton where megatron-core needs it to import). A finished environment is
stamped and reused. The script prints the table docs/compat.md shows: version -> passed / failed /
skipped / errors / seconds / when it ran (UTC) / the commit it ran on, and exits non-zero if any
version failed.

    python3.11 -m scripts.compat_matrix                      # every version
    python3.11 -m scripts.compat_matrix 0.15.3 0.19.2        # only these
    python3.11 -m scripts.compat_matrix --build-only         # the environments, no tests
    python3.11 -m scripts.compat_matrix --smoke              # the CI smoke: 0.15.3 and 0.19.2

Standard library only: it runs with the interpreter that builds the environments.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / ".compat"
# The newest release of each minor line pyproject admits (docs/compat.md lists the same ones;
# tests/test_compat.py keeps the range, the table and this list in step).
VERSIONS = ("0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2")
TEST_PATHS = ("tests/ops", "tests/masks", "tests/transformer", "tests/training")
# `--smoke` (`make compat-smoke`, run by .ci/run): the dense, MoE and MLA models from the NPU spec,
# one forward and backward each, a checkpoint save and load, on the oldest and newest version
SMOKE_PATHS = ("tests/transformer/test_compat_smoke.py",)
SMOKE_VERSIONS = ("0.15.3", "0.19.2")
# megatron-core 0.18+ imports triton unconditionally without declaring it (on Ascend,
# triton-ascend provides the module); on a CPU host the plain wheel imports.
TRITON = "triton==3.9.0"


def _pip(env: Path, *args: str) -> None:
    """Run ``env``'s pip quietly; raise with pip's output if it fails."""
    cmd = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")


def _missing_module(env: Path) -> str | None:
    """The module ``import megatron.core`` misses in ``env`` (None: it imports)."""
    probe = "import megatron.core"
    proc = subprocess.run(
        [str(env / "bin" / "python"), "-c", probe], capture_output=True, text=True
    )
    found = re.search(r"No module named '([\w.]+)'", proc.stderr)
    return found.group(1).split(".")[0] if proc.returncode and found else None


def build(version: str, python: str) -> Path:
    """Create (or reuse) ``.compat/<version>``: the lock, then megatron-core ``version``."""
    env = COMPAT / version
    stamp = env / ".installed"
    if stamp.exists():
        return env
    subprocess.run([python, "-m", "venv", str(env)], check=True)
    _pip(env, "-r", "requirements.lock")
    _pip(env, "--no-deps", "--ignore-requires-python", f"megatron-core=={version}")
    if _missing_module(env) == "triton":  # 0.18+ import triton at `import megatron.core`
        _pip(env, "--no-deps", TRITON)
    _pip(env, "--no-deps", "--no-build-isolation", "-e", ".")
    stamp.write_text(version + "\n")
    return env


def parse_summary(text: str) -> dict[str, int] | None:
    """Counts from pytest's last summary line, e.g. ``3 failed, 120 passed, 2 skipped in 9s``;
    None when there is none (pytest killed or crashed)."""
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|errors?)\b", ln)]
    if not lines:
        return None
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors"), 0)
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", lines[-1]):
        counts["errors" if word.startswith("error") else word] += int(number)
    return counts


def commit() -> str:
    """The short hash of the checked-out commit, ``-dirty`` when tracked files differ from it."""
    proc = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    return proc.stdout.strip() if proc.returncode == 0 else "unknown"


def _utc_now() -> str:
    """The wall clock, ``HH:MM`` UTC."""
    return datetime.now(timezone.utc).strftime("%H:%M")


def run_tests(env: Path, workers: int, extra: list[str], paths=TEST_PATHS,
              log_name: str = "pytest.log") -> tuple[dict | None, float, int, str]:  # fmt: skip
    """Run ``paths`` in ``env``; the full log goes to ``env/<log_name>``. Returns the counts, the
    wall seconds, pytest's exit status and when it ran (``HH:MM-HH:MM`` UTC)."""
    xdist = ["-n", str(workers), "--dist", "loadfile"] if workers > 0 else []
    cmd = [str(env / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
           *xdist, *paths, *extra]  # fmt: skip
    start, began = time.monotonic(), _utc_now()
    with open(env / log_name, "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    seconds, ran = time.monotonic() - start, f"{began}-{_utc_now()}"
    return parse_summary((env / log_name).read_text()), seconds, proc.returncode, ran


def table(rows: list[tuple[str, dict | None, float, str]], at: str) -> str:
    """The markdown table docs/compat.md shows: one row per ``(version, counts, seconds, ran)``,
    all run on commit ``at``."""
    out = ["| megatron-core | passed | failed | skipped | errors | seconds | ran (UTC) | commit |",
           "|---|---:|---:|---:|---:|---:|---|---|"]  # fmt: skip
    for version, c, secs, ran in rows:
        counts = ("no pytest summary (killed or crashed) | | |" if c is None else
                  f"{c['passed']} | {c['failed']} | {c['skipped']} | {c['errors']}")  # fmt: skip
        out.append(f"| {version} | {counts} | {secs:.0f} | {ran} | {at} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("versions", nargs="*")
    ap.add_argument("--python", default=os.environ.get("PYTHON", "python3.11"))
    ap.add_argument("--workers", type=int, default=int(os.environ.get("TEST_WORKERS", "2")))
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help=f"only {' '.join(SMOKE_PATHS)} (default versions: "
                         f"{' '.join(SMOKE_VERSIONS)}), log smoke.log")  # fmt: skip
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    args = ap.parse_args(argv)
    versions = args.versions or list(SMOKE_VERSIONS if args.smoke else VERSIONS)
    envs = [build(v, args.python) for v in versions]
    if args.build_only:
        return 0
    paths, log_name = (SMOKE_PATHS, "smoke.log") if args.smoke else (TEST_PATHS, "pytest.log")
    rows, bad, at = [], [], commit()
    for version, env in zip(versions, envs):
        counts, secs, rc, ran = run_tests(env, args.workers, args.pytest_args.split(), paths,
                                          log_name)  # fmt: skip
        rows.append((version, counts, secs, ran))
        print(f"megatron-core {version}: {counts} in {secs:.0f}s (log {env}/{log_name})",
              flush=True)  # fmt: skip
        if rc:
            bad.append(version)
            if args.smoke:  # CI shows why
                print((env / log_name).read_text()[-6000:], file=sys.stderr)
    print(table(rows, at))
    if bad:
        print(f"test-compat: failures on megatron-core {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
