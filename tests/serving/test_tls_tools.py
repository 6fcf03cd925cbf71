"""Our own tools against the stack with mutual TLS and protected health, from one config.

``make serve`` starts TorchServe and a gateway with ``RECSYS_GATEWAY_TLS_*`` (server
certificate, client CA: mutual TLS) and ``auth.protect_health``, and must see it SERVING; the
client settings are the documented ``RECSYS_CLIENT_TLS_*`` variables, the token the file ``make
serve`` writes. Then ``make status``, ``make score``, the rollout tool's channel (KServe
``ModelReady``) and its evaluation, the container healthcheck (from the gateway's own
variables only) and a short Locust run all reach it; ``make stop`` ends it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recsys_stack.config import load
from recsys_stack.net import free_ports
from serving.tools import rollout
from tests.conftest import ROOT, _env
from tests.serving.test_supervisor import PORT_VARS, _tsv_rows
from tests.stack import STARTUP_TIMEOUT_S, ours

pytestmark = pytest.mark.slow


def _labelled(s: np.lib.npyio.NpzFile, n: int) -> str:
    """``n`` sample rows, labels alternating 0/1 (AUC needs both)."""
    lines = _tsv_rows(s, n).splitlines()
    return "".join(f"{i % 2}{line[1:]}\n" for i, line in enumerate(lines))


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_tools_work_against_mutual_tls_and_protected_health(
    exported: tuple[Path, Path, str],
    certs: dict[str, Path],
    tmp_path: Path,
) -> None:
    export, store, _ = exported
    make = shutil.which("make")
    assert make, "make not found: `apt-get install make`"
    ports = free_ports(7)
    workdir = tmp_path / "serve"
    server = {"RECSYS_GATEWAY_PORT": str(ports[5]), "RECSYS_GATEWAY_METRICS_PORT": str(ports[6]),
              "RECSYS_GATEWAY_TLS_CERT": str(certs["server.pem"]),
              "RECSYS_GATEWAY_TLS_KEY": str(certs["server.key"]),
              "RECSYS_GATEWAY_TLS_CLIENT_CA": str(certs["ca.pem"])}  # fmt: skip
    client = {"RECSYS_CLIENT_TLS_CA": str(certs["ca.pem"]),
              "RECSYS_CLIENT_TLS_CERT": str(certs["client.pem"]),
              "RECSYS_CLIENT_TLS_KEY": str(certs["client.key"])}  # fmt: skip
    env = _env({f"RECSYS_TS_{n}_PORT": str(p) for n, p in zip(PORT_VARS, ports, strict=False)})
    env.pop("RECSYS_GATEWAY_TOKEN_FILE", None)  # the one `make serve` writes
    env.update(server, **client, RECSYS_SERVE_DIR=str(workdir))
    venv = Path(sys.executable).parent.parent
    serve_args = (f"SERVE_ARGS=--torchserve.model-store {store} --torchserve.workers 1 "
                  f"--gateway.auth.protect-health --timeout-s {STARTUP_TIMEOUT_S}")  # fmt: skip
    common = [f"VENV={venv}", f"RUN={export.parent}", serve_args]

    def run(target: str, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [make, "--no-print-directory", "-o", f"{venv}/.installed", target, *common, *args]
        return _run(cmd, env)

    s = np.load(export / "sample.npz")
    tsv = tmp_path / "rows.tsv"
    tsv.write_text(_labelled(s, 20))
    target = f"127.0.0.1:{ports[5]}"
    started = run("serve")
    try:
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
        status = run("status")
        assert status.returncode == 0 and f"gateway {target}: SERVING" in status.stdout, status

        scored = run("score", f"DATA={tsv}", "ROWS=5")
        assert scored.returncode == 0, scored.stderr
        got = [float(line.split("\t")[1]) for line in scored.stdout.splitlines()[-5:]]
        np.testing.assert_allclose(got, s["probs_int8"][:5], atol=1e-6)

        # the rollout tool: its KServe channel and its evaluation through the gateway
        cfg = load(rollout.RolloutConfig, environ=env,
                   overrides=[f"workdir={workdir}", f"eval_data={tsv}", "progress=false"])  # fmt: skip
        assert cfg.tls_cert == str(certs["client.pem"])  # RECSYS_CLIENT_TLS_CERT
        stack = rollout.Stack.find(cfg, cfg.workdir)
        gw = rollout.Gateway(stack)
        try:
            assert gw.ready("dlrm-tiny", "1.0") is True
            assert gw.ready("dlrm-tiny", "9") is None
        finally:
            gw.close()
        assert rollout.evaluate_version(cfg, stack, "1.0")["rows"] == 2  # holdout: the last 10%

        # the container healthcheck: the gateway's own variables, its token file
        health_env = _env({**server, "RECSYS_GATEWAY_TOKEN_FILE": str(workdir / "gateway_token")})
        check = _run([sys.executable, "docker/healthcheck.py", "gateway"], health_env)
        assert check.returncode == 0, check.stderr

        out = tmp_path / "locust"
        locust = _run(
            [sys.executable, "-m", "loadtest.run", "--host", target, "--data", str(tsv),
             "--examples", "5", "-u", "1", "-r", "1", "-t", "3s", "--out", str(out),
             "--slo-failure-ratio", "0"], env,
        )  # fmt: skip
        assert locust.returncode == 0, locust.stdout + locust.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["requests"] > 0 and summary["failures"] == 0, summary
    finally:
        stopped = run("stop")
    assert stopped.returncode == 0 and "stopped gateway, torchserve" in stopped.stdout, stopped
    assert not ours(workdir)
