"""The README's commands run as printed on this machine.

A code block the README marks fast (an HTML comment line ``<!-- fast -->`` right before its
fence) is run line by line: each line that starts with ``make `` or ``recsys-`` goes to bash
exactly as written (its ``#`` comment included), after ``source .venv/bin/activate`` when the
README tells the reader to activate, and must exit 0. The marked blocks hold only commands that
need no running stack and no build (``--help``, ``make help``, ``make status``), so this takes
seconds; ``RECSYS_SERVE_DIR`` points at an empty folder so that ``make status`` sees nothing
running whatever else this machine serves.
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


def test_the_marker_finds_the_blocks() -> None:
    text = f"{MARK}\n```bash\nmake help   # x\npip install y\nrecsys-a --help\n```\nmake no\n"
    assert fast_lines(text) == ["make help   # x", "recsys-a --help"]
    assert len(LINES) >= len(SCRIPTS) + 2, LINES


def test_every_console_script_is_listed_and_activation_is_said() -> None:
    listed = {line.split()[0] for line in LINES if line.startswith("recsys-")}
    assert set(SCRIPTS) <= listed, sorted(set(SCRIPTS) - listed)
    # the scripts live in .venv/bin: the README says how they get on PATH, before using them
    assert ACTIVATE in README and README.index(ACTIVATE) < README.index(MARK)


@pytest.mark.parametrize("line", LINES)
def test_a_fast_readme_line_runs_as_written(line: str, tmp_path: Path) -> None:
    env = _env({"RECSYS_SERVE_DIR": str(tmp_path / "serve")})
    activate = f"source {VENV_BIN / 'activate'} && " if ACTIVATE in README else ""
    proc = subprocess.run(
        ["bash", "-c", activate + line], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    command = line.split()[0]
    if command.startswith("recsys-") and "--help" in line.split():
        # the usage line shows the command the user typed
        assert re.match(rf"usage: {re.escape(command)}\b", proc.stdout), proc.stdout[:200]
    if line.startswith("make status"):
        assert "not running" in proc.stdout, proc.stdout
