"""The serving benchmark: the peer's handler scores like the artifact, the ratios are right, and
a tiny real run (two TorchServes, the gateway) reports every method at every cell.

No speed assertion: figures belong to ``python -m serving.bench`` runs, not to tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from serving.bench.config import LOGGED, METHODS
from serving.bench.measure import Cell
from serving.bench.model import Model, payload
from serving.bench.plain_handler import PlainHandler
from serving.bench.report import results, table
from serving.bench.run import in_order
from tests.conftest import third_party_noise

ROOT = Path(__file__).resolve().parents[2]


def test_plain_handler_scores_like_the_artifact(
    exported_portable: tuple[Path, Path, str],
) -> None:
    model = Model.load(exported_portable[0])
    handler = PlainHandler()
    handler.model = torch.jit.load(str(model.plain_artifact))
    a, b = payload(model, 3), payload(model, 5)
    batch = [{"body": json.loads(a.plain_json)}, {"data": json.loads(b.plain_json)}]
    out = handler.postprocess(handler.inference(handler.preprocess(batch)))
    assert [len(x) for x in out] == [3, 5]
    with torch.inference_mode():
        want = handler.model(*(torch.from_numpy(x) for x in (b.dense, b.values, b.lengths)))
    np.testing.assert_allclose(out[1], want.numpy(), atol=1e-6)


def test_ratios_are_to_plain_at_the_same_cell_and_to_in_process_at_the_same_size() -> None:
    cells = [Cell("in-process", 10, 1), Cell("plain-torchserve", 10, 4), Cell("gateway", 10, 4)]
    for cell, ms, wall in zip(cells, (1.0, 20.0, 10.0), (0.1, 1.0, 0.5), strict=True):
        cell.add([ms] * 10, wall, [])
    rows = {r["method"]: r for r in results(cells)}
    assert rows["in-process"]["examples_per_s"] == pytest.approx(1000)
    gw = rows["gateway"]
    assert gw["examples_per_s_vs_plain"] == pytest.approx(2.0)
    assert gw["p50_vs_plain"] == pytest.approx(0.5)
    assert gw["efficiency"] == pytest.approx(0.2)
    assert rows["in-process"]["p50_vs_plain"] is None  # no plain cell at concurrency 1
    assert "gateway" in table(list(rows.values()))


def test_each_round_runs_every_cell_once_and_odd_rounds_reverse_the_methods() -> None:
    cells = {(x, n, c): Cell(x, n, c) for n in (1, 100) for c in (1, 4) for x in ("a", "b", "c")}
    first, second = ([key for key, _ in in_order(cells, k)] for k in (0, 1))
    assert sorted(first) == sorted(second) == sorted(cells)
    assert first[:3] == [("a", 1, 1), ("b", 1, 1), ("c", 1, 1)]
    assert second[:3] == [("c", 1, 1), ("b", 1, 1), ("a", 1, 1)]
    assert [key[1:] for key in second[::3]] == [(1, 1), (1, 4), (100, 1), (100, 4)]


def test_a_tiny_run_measures_every_method_at_every_cell(
    exported_portable: tuple[Path, Path, str], tmp_path: Path
) -> None:
    export, store, _ = exported_portable
    out = tmp_path / "bench.json"
    args = [
        "--export", str(export), "--model-store", str(store), "--sizes", "[1, 10]",
        "--concurrency", "[1, 2]", "--requests", "4", "--rounds", "1", "--warmup", "2", "--warmup-s", "0.5",
        "--json", str(out), "--feature-log",  # gateway+log too: the feature log's cost
    ]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "serving.bench", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not third_party_noise(proc.stdout + proc.stderr), third_party_noise(proc.stderr)[:10]
    doc = json.loads(out.read_text())
    got = {(r["method"], r["examples"], r["concurrency"]): r for r in doc["results"]}
    want = {
        (m, n, c) for m in [*METHODS, LOGGED] for n in (1, 10) for c in (1, 2)
        if m != "in-process" or c == 1
    }  # fmt: skip
    assert set(got) == want
    for r in got.values():
        assert r["errors"] == 0 and r["requests"] >= 4, r
        assert r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] and r["examples_per_s"] > 0, r
        busy = r["machine_busy"]  # the machine's share of busy cores; None: under a clock tick
        assert busy is None or 0 <= busy <= 1, r
    assert any(r["machine_busy"] for r in got.values())
    methods = doc["settings"]["methods"]
    assert methods["plain-torchserve"]["batch_size"] == 1
    assert methods["plain-torchserve"]["workers"] == doc["settings"]["usable_cores"]
    assert methods["plain-torchserve"]["threads_per_worker"] == [1]  # --plain-threads 1
    assert "plain-torchserve" in proc.stdout and "efficiency" in proc.stdout
    assert methods[LOGGED]["gateway"]["feature_log"]["enabled"]
    assert not methods["gateway"]["gateway"]["feature_log"]["enabled"]
    # the lite backend (serving/lite): as many workers as the stack's TorchServe
    assert methods["gateway-lite"]["workers"] == methods["torchserve-grpc"]["workers"]


def test_the_refusal_floor_tool_runs_and_prints_its_figures() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "serving.bench.burst", "--callers", "4", "--processes", "2",
         "--bytes", "1000", "--seconds", "0.5"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refusals by a server that only refuses: p50" in proc.stdout


def test_the_own_cost_tool_runs_the_real_handler_chain(
    exported_portable: tuple[Path, Path, str],
) -> None:
    export, _, _ = exported_portable
    proc = subprocess.run(
        [sys.executable, "-m", "serving.bench.own_cost", "--export", str(export),
         "--sizes", "[1, 10]", "--calls", "20", "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])["us_per_call"]
    assert set(got) == {"1", "10"} and all(v > 0 for v in got.values()), got
    missing = subprocess.run(
        [sys.executable, "-m", "serving.bench.own_cost", "--export", "/nonexistent"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2 and "give --export" in missing.stderr


def test_the_floor_report_names_each_missed_target() -> None:
    """serving/bench/floor.py: the floor = in-process x workers; each gateway against
    TorchServe direct and its share of the floor, every target checked."""
    from serving.bench.floor import report

    def row(method: str, n: int, c: int, ex_s: float, p50: float = 5.0) -> dict[str, Any]:
        return {"method": method, "examples": n, "concurrency": c, "examples_per_s": ex_s,
                "p50_ms": p50, "cpu_ms_per_request": {"client": 0.5, "gateway": 1.0}}  # fmt: skip

    doc = {
        "settings": {"date": "d", "cores": 2, "loadavg_before": [0.1], "loadavg_after": [0.2],
                     "model": {"name": "m"}, "methods": {"torchserve-grpc": {"workers": 2}}},
        "results": [
            row("in-process", 1000, 1, 50_000), row("in-process", 1, 1, 4_000),
            row("torchserve-grpc", 1000, 4, 70_000), row("torchserve-grpc", 1, 64, 900),
            row("torchserve-grpc", 1, 1, 300, 3.0),
            row("gateway", 1000, 4, 60_000), row("gateway", 1, 64, 1_500),
            row("gateway", 1, 1, 250, 4.0),
            row("gateway-lite", 1000, 4, 85_000), row("gateway-lite", 1, 64, 2_600),
            row("gateway-lite", 1, 1, 700, 4.2),
        ],
    }  # fmt: skip
    text, missed = report(doc)
    assert "100,000" in text  # the floor at 1,000 examples: 50,000 x 2 workers
    assert sorted(missed) == sorted([
        "gateway 1000 x 4: 0.86x TorchServe direct (target >= 1)",
        "gateway 1000 x 4: 0.60 of the floor (target >= 0.8)",
        "gateway 1 x 1: 0.83x TorchServe direct (target >= 1)",
        "gateway 1 x 64: 0.19 of the floor (target >= 0.3)",
    ])  # fmt: skip
    # the lite gateway met each of its targets; its p50 (4.2) within this run's gateway + 0.3
    assert not [m for m in missed if m.startswith("gateway-lite")]
    slower = {**doc, "results": [
        {**r, "p50_ms": 4.5} if r["method"] == "gateway-lite" and r["concurrency"] == 1 else r
        for r in doc["results"]
    ]}  # fmt: skip
    assert "gateway-lite p50 at 1 x 1: 4.50 ms > 4.00 + 0.3 ms" in report(slower)[1]
