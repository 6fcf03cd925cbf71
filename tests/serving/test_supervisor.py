"""``make serve`` / ``make status`` / ``make score`` / ``make stop`` as a user runs them: the
supervisor and the client as subprocesses, ports from the environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recsys_stack.net import free_ports
from serving.codec import to_rows
from tests.conftest import ROOT, _env
from tests.stack import ours

pytestmark = pytest.mark.slow
PORT_VARS = ["INFERENCE", "MANAGEMENT", "METRICS", "GRPC_INFERENCE", "GRPC_MANAGEMENT"]


def test_serve_status_score_stop(exported: tuple[Path, Path, str], tmp_path: Path) -> None:
    export, store, _ = exported
    ports = free_ports(6)
    env = _env({f"RECSYS_TS_{n}_PORT": str(p) for n, p in zip(PORT_VARS, ports, strict=False)})
    env["RECSYS_GATEWAY_PORT"] = str(ports[5])
    env["RECSYS_SERVE_DIR"] = str(tmp_path / "serve")
    supervisor = [sys.executable, "-m", "serving.supervisor"]
    start = [*supervisor, "start", "--gateway.schema", str(export / "schema.json"),
             "--torchserve.model-store", str(store)]  # fmt: skip

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )

    started = run(*start)
    try:
        assert started.returncode == 0, started.stderr[-2000:]
        assert f"gateway 127.0.0.1:{ports[5]}" in started.stdout
        keys = tmp_path / "serve" / "torchserve" / "key_file.json"  # follows RECSYS_SERVE_DIR
        assert keys.is_file()
        again = run(*start)
        assert again.returncode == 2 and "already running" in again.stderr
        status = run(*supervisor, "status")
        assert status.returncode == 0, status.stdout + status.stderr
        cores = os.cpu_count() or 1  # default workers: one per core
        assert f"{cores} READY workers" in status.stdout and "SERVING" in status.stdout
        # score 5 rows of a TSV built from the sample's first rows
        s = np.load(export / "sample.npz")
        tsv = tmp_path / "rows.tsv"
        tsv.write_text(_tsv_rows(s, 5))
        scored = run(sys.executable, "-m", "serving.client", "--data", str(tsv), "--rows", "5")
        assert scored.returncode == 0, scored.stderr
        got = [float(line.split("\t")[1]) for line in scored.stdout.splitlines()]
        np.testing.assert_allclose(got, s["probs_int8"][:5], atol=1e-6)
    finally:
        stopped = run(*supervisor, "stop")
    assert stopped.returncode == 0 and "stopped gateway, torchserve" in stopped.stdout
    assert not ours(tmp_path / "serve")
    assert run(*supervisor, "status").returncode == 3  # not running
    assert not keys.exists()


def _tsv_rows(s: np.lib.npyio.NpzFile, n: int) -> str:
    sparse = to_rows(s["values"], s["lengths"])
    lines = []
    for i in range(n):
        ints = [str(int(x)) if x else "" for x in s["dense"][i]]
        ids = [f"{int(x):08x}" if x >= 0 else "" for x in sparse[i]]
        lines.append("\t".join(["0", *ints, *ids]))
    return "\n".join(lines) + "\n"
