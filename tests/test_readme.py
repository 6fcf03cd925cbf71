"""The README's and the guides' commands run as printed on this machine; their links resolve.

A code block a page (README.md or a guide under docs/) marks fast (an HTML comment line
``<!-- fast -->`` right before its fence) is run line by line: each line that starts with
``make `` or ``recsys-`` goes to bash exactly as written (its ``#`` comment included), after
``source .venv/bin/activate`` when the page tells the reader to activate, and must exit 0. The
marked blocks hold only commands that need no running stack and no build (``--help``, ``make
help``, ``make status``), so this takes seconds; ``RECSYS_SERVE_DIR`` points at an empty folder
so that ``make status`` sees nothing running whatever else this machine serves.

The README is the front page (what it is, the first commands, a tour, where to read next): the
depth lives in docs/, so every relative link, and every ``docs/...`` file a page names in code,
must exist, and the benchmarks' JSON figures are one file per kind under docs/results/.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT, VENV_BIN, _env

README = (ROOT / "README.md").read_text()
MARK = "<!-- fast -->"
ACTIVATE = "source .venv/bin/activate"
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
PAGES = {
    "README.md": README,
    **{f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))},
}
README_MAX_LINES = 200
# The fast lines the README alone had before the guides took its depth: the set may only grow.
FAST_LINES_BEFORE_THE_GUIDES = 16
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DOCS_PATH = re.compile(r"`((?:docs|tests)/[\w./-]+\.(?:md|json|png|py))`")


def fast_lines(text: str) -> list[str]:
    """The ``make``/``recsys-`` lines of the code blocks marked fast, in order."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        if line.strip() != MARK or not lines[i + 1].startswith("```"):
            continue
        for body in lines[i + 2 :]:
            if body.startswith("```"):
                break
            if body.startswith(("make ", "recsys-")):
                out.append(body)
    return out


LINES = fast_lines(README)
CASES = [(page, line) for page, text in PAGES.items() for line in fast_lines(text)]


def test_the_marker_finds_the_blocks() -> None:
    text = f"{MARK}\n```bash\nmake help   # x\npip install y\nrecsys-a --help\n```\nmake no\n"
    assert fast_lines(text) == ["make help   # x", "recsys-a --help"]
    assert len(LINES) >= len(SCRIPTS) + 2, LINES
    assert len(CASES) >= FAST_LINES_BEFORE_THE_GUIDES, CASES


def test_every_console_script_is_listed_and_activation_is_said() -> None:
    listed = {line.split()[0] for line in LINES if line.startswith("recsys-")}
    assert set(SCRIPTS) <= listed, sorted(set(SCRIPTS) - listed)
    # the scripts live in .venv/bin: each page says how they get on PATH, before using them
    for page, text in PAGES.items():
        if fast_lines(text):
            assert ACTIVATE in text and text.index(ACTIVATE) < text.index(MARK), page


def test_the_readme_is_a_front_page() -> None:
    count = len(README.splitlines())
    assert count <= README_MAX_LINES, (
        f"README.md has {count} lines (at most {README_MAX_LINES}): move the depth into a guide "
        "under docs/ and link it"
    )


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_relative_link_points_at_a_file(page: str) -> None:
    base = (ROOT / page).parent
    missing = []
    for target in LINK.findall(PAGES[page]):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the page itself
        if not (base / target.split("#")[0]).exists():
            missing.append(target)
    for named in DOCS_PATH.findall(PAGES[page]):
        if "*" not in named and "<" not in named and not (ROOT / named).exists():
            missing.append(named)
    assert not missing, f"{page} points at files that do not exist: {missing}"


def test_the_bench_figures_are_one_json_per_kind_in_docs_results() -> None:
    assert not sorted((ROOT / "docs").glob("*.json")), "benchmark JSON belongs in docs/results/"
    kinds: dict[str, list[str]] = {}
    for path in sorted((ROOT / "docs" / "results").glob("*.json")):
        kind = re.sub(r"-\d{4}-\d{2}-\d{2}[a-z]?$", "", path.stem)
        kinds.setdefault(kind, []).append(path.name)
    assert kinds, "docs/results/ holds no benchmark JSON"
    older = {kind: names for kind, names in kinds.items() if len(names) > 1}
    assert not older, f"only the latest JSON of each kind stays (older ones are in git): {older}"


@pytest.mark.parametrize(("page", "line"), CASES, ids=[f"{p}: {ln}" for p, ln in CASES])
def test_a_fast_line_runs_as_written(page: str, line: str, tmp_path: Path) -> None:
    env = _env({"RECSYS_SERVE_DIR": str(tmp_path / "serve")})
    activate = f"source {VENV_BIN / 'activate'} && " if ACTIVATE in PAGES[page] else ""
    proc = subprocess.run(
        ["bash", "-c", activate + line], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, f"{page}: {line}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    command = line.split()[0]
    if command.startswith("recsys-") and "--help" in line.split():
        # the usage line shows the command the user typed
        assert re.match(rf"usage: {re.escape(command)}\b", proc.stdout), proc.stdout[:200]
    if line.startswith("make status"):
        assert "not running" in proc.stdout, proc.stdout
