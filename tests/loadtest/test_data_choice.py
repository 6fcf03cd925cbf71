"""Which rows a load test draws from when none are given (issue 46 item 2): ``make loadtest``
took the first data/synthetic/*.tsv in name order, so the demo's load test ran on the tiny
preset's file once tiny had been trained (8,569 examples/s against 30,434), and own-data models
were measured on synthetic rows; the result line did not name the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.config import LoadConfig, default_data, resolve_data, schema_data
from loadtest.run import result_line
from recsys_stack.config import ConfigError


def test_the_rows_are_the_models_own(exported: tuple[Path, Path, str]) -> None:
    export = exported[0]
    schema = json.loads((export / "schema.json").read_text())
    path, why = schema_data(export / "schema.json")
    recorded = json.dumps(schema["data"])
    assert path.name in recorded and "data" in why, (path, why, recorded)
    cfg = LoadConfig()
    resolve_data(cfg, export / "schema.json")
    assert cfg.data == path
    given = LoadConfig(data=Path("/x.tsv"))
    resolve_data(given, export / "schema.json")
    assert given.data == Path("/x.tsv")  # a file given is kept


def test_with_nothing_served_the_choice_is_said(tmp_path: Path) -> None:
    try:
        path, why = default_data(tmp_path / "no-stack")
    except ConfigError as e:  # no synthetic file on this machine either: one line says what to do
        assert "make serve" in str(e) or "--data" in str(e)
        return
    assert "nothing is serving" in why and path.suffix == ".tsv"


def test_a_schema_without_data_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "schema.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"--data FILE\.tsv"):
        schema_data(tmp_path / "schema.json")


def test_the_result_line_names_the_file() -> None:
    s = {"requests": 10, "failures": 0, "failure_ratio": 0.0, "failures_by_type": {},
         "rps": 5.0, "examples_per_request": 100, "p50_ms": 1, "p95_ms": 2, "p99_ms": 3,
         "successes": 10, "data": "/data/own.tsv"}  # fmt: skip
    assert "rows of /data/own.tsv" in result_line(s)
