"""``make serve`` / ``make score`` / ``make stop`` as a user runs them (free ports via env)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from serving.codec import to_rows
from serving.torchserve import free_ports
from tests.conftest import ROOT, _env

pytestmark = pytest.mark.slow


def test_serve_score_stop(exported: tuple[Path, Path, str], tmp_path: Path) -> None:
    export, store, _ = exported
    ports = free_ports(6)
    names = ["INFERENCE", "MANAGEMENT", "METRICS", "GRPC_INFERENCE", "GRPC_MANAGEMENT"]
    env = _env({f"RECSYS_TS_{n}_PORT": str(p) for n, p in zip(names, ports, strict=False)})
    env["RECSYS_GATEWAY_PORT"] = str(ports[5])
    workdir = tmp_path / "serve"
    stack = [sys.executable, "-m", "serving.stack"]
    common = ["--workdir", str(workdir)]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )

    started = run(
        *stack,
        "start",
        *common,
        "--schema",
        str(export / "schema.json"),
        "--model-store",
        str(store),
    )
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        assert f"gateway 127.0.0.1:{ports[5]}" in started.stdout
        again = run(
            *stack,
            "start",
            *common,
            "--schema",
            str(export / "schema.json"),
            "--model-store",
            str(store),
        )
        assert again.returncode == 2 and "already running" in again.stderr
        # score 5 rows of a TSV built from the sample's first rows
        s = np.load(export / "sample.npz")
        tsv = tmp_path / "rows.tsv"
        tsv.write_text(_tsv_rows(s, 5))
        scored = run(sys.executable, "-m", "serving.client", "--data", str(tsv), "--rows", "5")
        assert scored.returncode == 0, scored.stderr
        got = [float(line.split("\t")[1]) for line in scored.stdout.splitlines()]
        np.testing.assert_allclose(got, s["probs_int8"][:5], atol=1e-6)
    finally:
        stopped = run(*stack, "stop", *common)
    assert stopped.returncode == 0
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(workdir) in " ".join(p.info["cmdline"] or [])
    ]
    assert not [p for p in leftovers if p.status() != psutil.STATUS_ZOMBIE]
    assert os.path.isdir(workdir)


def _tsv_rows(s: np.lib.npyio.NpzFile, n: int) -> str:
    sparse = to_rows(s["values"], s["lengths"])
    lines = []
    for i in range(n):
        ints = [str(int(x)) if x else "" for x in s["dense"][i]]
        ids = [f"{int(x):08x}" if x >= 0 else "" for x in sparse[i]]
        lines.append("\t".join(["0", *ints, *ids]))
    return "\n".join(lines) + "\n"
