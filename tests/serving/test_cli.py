"""Every serving command: --help documents each option, a misspelled key is one line with a
suggestion, and the torch-free side (gateway, client, validation) never imports torch."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, _env

COMMANDS = {
    "gateway": ["-m", "serving.gateway"],
    "client": ["-m", "serving.tools.client"],
    "supervisor": ["-m", "serving.tools.supervisor", "status"],
    "torchserve entry": ["docker/torchserve_entry.py"],
}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60
    )


def options(help_text: str) -> dict[str, str]:
    """``{--flag: its help}`` from argparse's ``--help`` output."""
    out: dict[str, str] = {}
    flag = None
    for line in help_text.splitlines():
        m = re.match(r"^  (-[-\w.]+)(?:,? [^ ].*?)?(?:  +(.*))?$", line)
        if m and line.startswith("  -"):
            flag = m.group(1).split(",")[0]
            out[flag] = (m.group(2) or "").strip()
        elif flag and line.startswith("   "):
            out[flag] = f"{out[flag]} {line.strip()}".strip()
    return out


@pytest.mark.parametrize("name", COMMANDS)
def test_help_documents_every_option(name: str) -> None:
    proc = _run(*COMMANDS[name], "--help")
    assert proc.returncode == 0, proc.stderr
    opts = options(proc.stdout)
    assert "--config" in opts and len(opts) > 4, proc.stdout
    undocumented = [f for f, text in opts.items() if not text or "(undocumented)" in text]
    assert undocumented == [], proc.stdout


def test_gateway_help_names_limits_and_variables() -> None:
    text = _run("-m", "serving.gateway", "--help").stdout
    assert "--limits.max-examples" in text and "Most examples in one request" in text
    for var in (
        "RECSYS_GATEWAY_PORT",
        "RECSYS_GATEWAY_HOST",
        "RECSYS_TS_GRPC",
        "RECSYS_TS_KEY_FILE",
    ):
        assert var in text


@pytest.mark.parametrize(
    ("name", "typo", "suggestion"),
    [
        ("gateway", "limits.max_example=5", "limits.max_examples"),
        ("client", "rowz=5", "rows"),
        ("supervisor", "gateway.prot=1", "gateway.port"),
        ("torchserve entry", "batch_sise=4", "batch_size"),
    ],
)
def test_a_misspelled_key_is_one_line_with_a_suggestion(
    name: str, typo: str, suggestion: str
) -> None:
    proc = _run(*COMMANDS[name], typo)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"did you mean '{suggestion}'?" in lines[0], lines[0]


@pytest.mark.parametrize(
    "module", ["serving.gateway", "serving.tools.client", "serving.gateway.validate"]
)
def test_the_torch_free_side_never_imports_torch(module: str) -> None:
    code = f"import {module}, sys; assert 'torch' not in sys.modules, '{module} imported torch'"
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr


def _row(i: int, label: str | None = None) -> str:
    """A well-formed row: label (``i % 2`` unless given), I1 = i, C1 = hex i, the rest empty."""
    return f"{i % 2 if label is None else label}\t{i}" + "\t" * 13 + f"{i:x}" + "\t" * 25


def _score(tmp_path, lines: list[str], *more: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    """``python -m serving.tools.client`` on a file of ``lines``; nothing listens on port 1."""
    data = tmp_path / "rows.tsv"
    data.write_text("\n".join(lines) + "\n")
    return _run("-m", "serving.tools.client", "--data", str(data), "--port", "1",
                "--timeout-s", "2", *more)  # fmt: skip


def test_the_client_refuses_an_empty_label_with_file_and_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = _score(tmp_path, [_row(0), _row(1, label=""), _row(2)])
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"error: {tmp_path / 'rows.tsv'}:2: column label: '' is not 0 or 1"
    )


def test_the_client_refuses_an_empty_line_between_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = _score(tmp_path, [_row(0), "", _row(1)])
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"error: {tmp_path / 'rows.tsv'}:2: empty line, expected 40 fields"
    )


def test_the_client_says_the_rows_it_really_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # 9 rows (and the empty lines that end a file) asked for 1,000: rows 1..9, then no gateway
    proc = _score(tmp_path, [_row(i) for i in range(9)] + ["", ""], "--rows", "1000")
    first = proc.stderr.splitlines()[0]
    assert first == f"scoring rows 1..9 of {tmp_path / 'rows.tsv'}", proc.stderr
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr
