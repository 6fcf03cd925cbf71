"""Every console script of pyproject.toml: --help documents its options, --config and
``section.key=value`` are accepted, and a misspelled key or flag is one line with a suggestion.

The entry functions run in this process (``main(argv)``); each stage's own tests run the real
programs as subprocesses.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# Arguments an entry point needs before its config (the supervisor's command).
LEADING = {"recsys-serve": ["status"]}


def _entry(script: str) -> Callable[..., Any]:
    module, _, func = SCRIPTS[script].partition(":")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), func)
    return fn


def _run(script: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = _entry(script)([*LEADING.get(script, []), *argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def test_the_scripts_cover_every_stage() -> None:
    assert {
        "recsys-train", "recsys-export", "recsys-serve", "recsys-gateway", "recsys-score",
        "recsys-loadtest", "recsys-calibrate", "recsys-protos",
    } <= set(SCRIPTS)  # fmt: skip


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_documents_every_option_and_takes_a_config_file(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        _entry(script)(["--help"])
    except SystemExit as e:
        assert e.code == 0
    text = capsys.readouterr().out
    assert "--config FILE.toml" in text and "section.key=value" in text, text[:500]
    assert "(undocumented)" not in text, f"{script}: a field has no docstring"


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_misspelled_key_is_one_line_naming_it(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(script, ["zz_not_a_key=1"], capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "unknown key 'zz_not_a_key'" in lines[0], err


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_misspelled_flag_gets_a_suggestion(
    script: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(script, ["--confg", "x.toml"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "did you mean '--config'?" in lines[0], err


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_missing_config_file_is_named(
    script: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nope.toml"
    code, _, err = _run(script, ["--config", str(missing)], capsys)
    assert code == 2 and f"config file not found: {missing}" in err, err


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_answers_without_importing_torch(script: str) -> None:
    """``--help`` in a fresh process of the console script's own function leaves torch
    unimported (importing torch, TorchRec and fbgemm costs 5-6 s of CPU before any option is
    read; training/launch.py)."""
    module, _, func = SCRIPTS[script].partition(":")
    argv = [*LEADING.get(script, []), "--help"]
    code = (
        f"import sys\nfrom {module} import {func} as main\ntry:\n    main({argv!r})\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print('imported torch' if 'torch' in sys.modules else 'torch-free')"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("torch-free"), f"{script} --help imported torch"


@pytest.mark.parametrize(
    "module",
    ["training.train", "training.continuous"],
)
def test_a_bad_key_is_answered_before_torch_is_imported(module: str) -> None:
    """Issue 46 item 4: ``python -m training.train`` (what ``make train`` runs first) imported
    torch before reading its config, so a misspelled key took 11 s (2-3.5 min at load 20) to
    be told. Now the config is checked first: one line, exit 2, torch never imported."""
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['-m', '--run-dir', 'runs/x', '--data-dir', 'runs/y', 'train.epochz=3']\n"
        "try:\n"
        f"    runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code, 'torch imported' if 'torch' in sys.modules else 'torch-free')\n"
    )
    if module == "training.train":
        code = code.replace("'--data-dir', 'runs/y', ", "")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.stdout.strip() == "exit 2 torch-free", (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.strip() == (
        "error: command line: unknown key 'train.epochz' (did you mean 'train.epochs'?)"
    )


def test_a_first_run_says_what_it_will_generate_before_torch_loads(tmp_path: Path) -> None:
    """Issue 46 item 3: a first ``make train`` was 89 s with no output at load (torch's import,
    then the data). Its first line now says what will be generated, where and how large,
    before torch is imported (the run is stopped at that import here)."""
    syn = tmp_path / "syn"
    code = (
        "import runpy, sys\n"
        "class Stop:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            print('importing torch', file=sys.stderr, flush=True)\n"
        "            raise SystemExit(0)\n"
        "sys.meta_path.insert(0, Stop())\n"
        f"sys.argv = ['-m', '--prepare-only', '--config', 'training/configs/demo.toml',\n"
        f"            '--run-dir', {str(tmp_path / 'run')!r}, 'data.synthetic_dir={syn}']\n"
        "runpy.run_module('training.train', run_name='__main__', alter_sys=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 2, proc.stderr[-2000:]
    assert (
        lines[0].startswith(
            f"first run: 4,000,000 synthetic rows to generate into {syn}/synthetic_r4000000_v1000_s0"
        )
        and "(~1.0 GB)" in lines[0]
    ), lines[0]
    assert lines[1] == "importing torch"
    (syn / "synthetic_r4000000_v1000_s0.tsv").parent.mkdir()
    (syn / "synthetic_r4000000_v1000_s0.tsv").write_text("")
    again = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert again.stderr.strip() == "importing torch", again.stderr[-2000:]
