"""serving/torchserve/probe.py: the kubelet's /readyz and /livez, served over real HTTP from
what a fake management API said, on a fake clock."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

from recsys_stack.net import free_ports
from serving.torchserve.probe import Probes, main, serve


def status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_ready_wants_a_ready_worker_live_wants_a_fresh_answer() -> None:
    now = [0.0]
    answer: list[Any] = [OSError("connection refused")]
    alive = [True]

    def describe() -> list[dict[str, Any]]:
        if isinstance(answer[0], Exception):
            raise answer[0]
        return list(answer[0])

    probes = Probes(describe, lambda: alive[0], stale_s=30.0, clock=lambda: now[0])
    (port,) = free_ports(1)
    server = serve(probes, port, host="127.0.0.1")
    try:
        probes.check()  # TorchServe not up yet
        assert (status(port, "/livez"), status(port, "/readyz")) == (503, 503)
        answer[0] = [{"workers": [{"status": "UNLOADING"}, {"status": "LOADING"}]}]
        probes.check()  # answering, the model still loading: alive, not ready
        assert (status(port, "/livez"), status(port, "/readyz")) == (200, 503)
        answer[0] = [{"workers": [{"status": "READY"}]}]
        probes.check()
        assert (status(port, "/livez"), status(port, "/readyz")) == (200, 200)
        assert main([f"http://127.0.0.1:{port}/readyz"]) == 0  # the command podman runs
        answer[0] = OSError("timed out")  # the frontend stops answering
        now[0] = 20.0
        probes.check()
        assert status(port, "/livez") == 200  # within stale_s of the last answer
        now[0] = 31.0
        assert (status(port, "/livez"), status(port, "/readyz")) == (503, 503)
        answer[0] = [{"workers": [{"status": "READY"}]}]
        probes.check()
        alive[0] = False  # TorchServe's process exited
        assert (status(port, "/livez"), status(port, "/readyz")) == (503, 503)
        assert status(port, "/other") == 404
        assert main([f"http://127.0.0.1:{port}/livez"]) == 1
    finally:
        server.shutdown()
