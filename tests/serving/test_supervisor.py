"""``make serve`` / ``make status`` / ``make score`` / ``make stop`` as a user runs them: the
Makefile's own targets (RUN and SERVE_ARGS pointing at the test's export, state in a temp
folder, ports from the environment)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recsys_stack.net import free_ports
from serving.worker.codec import to_rows
from tests.conftest import ROOT, _env
from tests.stack import ours

pytestmark = pytest.mark.slow
PORT_VARS = ["INFERENCE", "MANAGEMENT", "METRICS", "GRPC_INFERENCE", "GRPC_MANAGEMENT"]


def test_make_serve_status_score_stop(exported: tuple[Path, Path, str], tmp_path: Path) -> None:
    export, store, _ = exported
    make = shutil.which("make")
    assert make, "make not found: `apt-get install make`"
    ports = free_ports(6)
    env = _env({f"RECSYS_TS_{n}_PORT": str(p) for n, p in zip(PORT_VARS, ports, strict=False)})
    env["RECSYS_GATEWAY_PORT"] = str(ports[5])
    env["RECSYS_SERVE_DIR"] = str(tmp_path / "serve")
    venv = Path(sys.executable).parent.parent
    # RUN=<the run holding export/>; the venv is this one, never rebuilt here (-o: treat
    # .installed as up to date even when a requirements file is newer)
    common = [f"VENV={venv}", f"RUN={export.parent}",
              f"SERVE_ARGS=--torchserve.model-store {store}"]  # fmt: skip

    def run(target: str, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [make, "--no-print-directory", "-o", f"{venv}/.installed", target, *common, *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    keys = tmp_path / "serve" / "torchserve" / "key_file.json"  # follows RECSYS_SERVE_DIR
    started = run("serve")
    try:
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        assert f"gateway 127.0.0.1:{ports[5]}" in started.stdout
        assert keys.is_file()
        # the gateway reads a copy holding the inference key alone, never TorchServe's file
        copy = keys.with_name("inference_key.json")
        assert list(json.loads(copy.read_text())) == ["inference"]
        assert copy.stat().st_mode & 0o777 == 0o600
        state = json.loads((tmp_path / "serve" / "serve.json").read_text())
        assert state["gateway"]["key_file"] == str(copy.resolve()), state["gateway"]
        again = run("serve")
        assert again.returncode != 0 and "already running" in again.stderr
        status = run("status")
        assert status.returncode == 0, status.stdout + status.stderr
        cores = os.cpu_count() or 1  # default workers: one per core
        assert f"{cores} READY workers" in status.stdout and "SERVING" in status.stdout
        # score 5 rows of a TSV built from the sample's first rows
        s = np.load(export / "sample.npz")
        tsv = tmp_path / "rows.tsv"
        tsv.write_text(_tsv_rows(s, 5))
        scored = run("score", f"DATA={tsv}", "ROWS=5")
        assert scored.returncode == 0, scored.stderr
        got = [float(line.split("\t")[1]) for line in scored.stdout.splitlines()[-5:]]
        np.testing.assert_allclose(got, s["probs_int8"][:5], atol=1e-6)
    finally:
        stopped = run("stop")
    out = stopped.stdout + stopped.stderr
    assert stopped.returncode == 0 and "stopped gateway, torchserve" in stopped.stdout, out
    # "make stop leaves nothing running": no process names the state folder, no key is left
    assert not ours(tmp_path / "serve")
    after = run("status")  # the supervisor's exit 3, "not running": an answer for make
    assert "not running" in after.stdout and after.returncode == 0, after
    assert not keys.exists() and not keys.with_name("inference_key.json").exists()


def test_a_gateway_that_exits_at_start_names_its_reason(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """A schema missing one feature: ``make serve`` prints the gateway's first error line
    (from gateway.log), naming the feature, and leaves nothing running."""
    export, store, _ = exported
    run_dir = tmp_path / "run"
    (run_dir / "export").mkdir(parents=True)
    schema = json.loads((export / "schema.json").read_text())
    schema["features"]["sparse"] = schema["features"]["sparse"][:-1]  # C26 dropped
    (run_dir / "export" / "schema.json").write_text(json.dumps(schema))
    make = shutil.which("make")
    assert make, "make not found: `apt-get install make`"
    ports = free_ports(6)
    env = _env({f"RECSYS_TS_{n}_PORT": str(p) for n, p in zip(PORT_VARS, ports, strict=False)})
    env |= {"RECSYS_GATEWAY_PORT": str(ports[5]), "RECSYS_SERVE_DIR": str(tmp_path / "serve")}
    venv = Path(sys.executable).parent.parent
    cmd = [make, "--no-print-directory", "-o", f"{venv}/.installed", "serve", f"VENV={venv}",
           f"RUN={run_dir}", f"SERVE_ARGS=--torchserve.model-store {store} --torchserve.workers 1"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stdout + proc.stderr
    assert errors[0].startswith("error: the gateway exited with code 2: "), errors
    assert "sparse feature C26: in the plan's, not in the gateway schema's" in errors[0], errors
    assert not ours(tmp_path / "serve")  # what was started is stopped


def test_a_port_answered_by_another_server_is_not_taken_for_ours(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """Another process holds the gateway's port and answers health SERVING there (seen: a make
    demo beside the suite). Ours cannot bind and says so in one line; ``make serve`` fails with
    that line instead of reporting "serving" on the other's answer, and leaves nothing."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    export, store, _ = exported
    ports = free_ports(6)
    other = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, other)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("recsys.v1.Ranker", health_pb2.HealthCheckResponse.SERVING)
    other.add_insecure_port(f"127.0.0.1:{ports[5]}")
    other.start()
    try:
        env = _env({f"RECSYS_TS_{n}_PORT": str(p) for n, p in zip(PORT_VARS, ports, strict=False)})
        env |= {"RECSYS_GATEWAY_PORT": str(ports[5]), "RECSYS_SERVE_DIR": str(tmp_path / "serve")}
        venv = Path(sys.executable).parent.parent
        make = shutil.which("make")
        assert make, "make not found: `apt-get install make`"
        cmd = [make, "--no-print-directory", "-o", f"{venv}/.installed", "serve", f"VENV={venv}",
               f"RUN={export.parent}",
               f"SERVE_ARGS=--torchserve.model-store {store} --torchserve.workers 1"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    finally:
        other.stop(None)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode != 0 and "serving dlrm" not in proc.stdout, proc.stdout + proc.stderr
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{ports[5]}: in use" in errors[0], (
        proc.stderr
    )
    assert "Traceback" not in (tmp_path / "serve" / "gateway.log").read_text()
    assert not ours(tmp_path / "serve")


def _tsv_rows(s: np.lib.npyio.NpzFile, n: int) -> str:
    sparse = to_rows(s["values"], s["lengths"])
    lines = []
    for i in range(n):
        ints = [str(int(x)) if x else "" for x in s["dense"][i]]
        ids = [f"{int(x):08x}" if x >= 0 else "" for x in sparse[i]]
        lines.append("\t".join(["0", *ints, *ids]))
    return "\n".join(lines) + "\n"
