"""The gateway's Prometheus metrics against the real stack, scraped by a real Prometheus.

A gateway (with a token file) in front of the module's TorchServe, its metrics endpoint on a
free port; the test's own calls (OK, INVALID_ARGUMENT, UNAUTHENTICATED) must show up exactly in
``/metrics``. Then ``prometheus`` (Debian's package; ``make test-deps`` installs it) on a
free port, with a generated config scraping the gateway and TorchServe's metrics API, is
queried over its HTTP API for the gateway's request counter and a TorchServe metric.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from recsys_stack.net import free_ports
from serving.gateway import metrics
from serving.gateway.config import AuthConfig, MetricsConfig
from serving.gateway.validate import Schema
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request
from serving.torchserve.config import TorchServeConfig
from serving.worker.codec import to_rows
from tests.conftest import ROOT, _env
from tests.stack import gateway_metrics, start_gateway, stop_gateway, wait_status

pytestmark = pytest.mark.slow
TOKEN = "metrics-test-token-" + "x" * 16
SCORE = "/recsys.v1.Ranker/Score"
N_OK, N_INVALID, N_UNAUTH, EXAMPLES = 7, 3, 2, 5


def test_size_buckets() -> None:
    assert metrics.size_buckets(1) == [1.0]
    assert metrics.size_buckets(1000) == [float(2**k) for k in range(11)]  # ... 512, 1024


def test_a_busy_metrics_port_does_not_stop_the_gateway() -> None:
    m = metrics.configure(10, 10)
    first = metrics.start_server(m, "127.0.0.1", free_ports(1)[0])
    assert first is not None
    try:
        assert metrics.start_server(m, "127.0.0.1", first.port) is None  # logged, not raised
        assert metrics.start_server(m, "127.0.0.1", 0) is None  # 0 = off
    finally:
        first.close()


def test_the_client_side_needs_no_prometheus_client() -> None:
    """The Locust image installs the load extra only: the client and its auth helpers must
    import without prometheus_client (the gateway's side imports it)."""
    code = "import sys; sys.modules['prometheus_client'] = None; import serving.tools.client"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def gateway(
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
    exported: tuple[Path, Path, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, int]]:
    """(gRPC target, metrics port) of a gateway with a token file and metrics on, in front of
    the module's TorchServe and a backend address where nothing listens."""
    export, _, _ = exported
    work = tmp_path_factory.mktemp("metrics")
    (work / "tokens").write_text(TOKEN + "\n")
    port = free_ports(1)[0]
    ts = torchserve[0]
    # a second backend where nothing listens: backend_healthy must tell the two apart
    dead = dataclasses.replace(ts, grpc_inference_port=free_ports(1)[0])
    proc, target = start_gateway(
        export / "schema.json", [ts, dead], work / "gateway.log",
        auth=AuthConfig(token_file=str(work / "tokens")), metrics=MetricsConfig(port=port),
    )  # fmt: skip
    try:
        wait_status(target, "SERVING", 120)
        yield target, port
    finally:
        assert stop_gateway(proc) == 0


@pytest.fixture(scope="module")
def calls(gateway: tuple[str, int], exported: tuple[Path, Path, str]) -> None:
    """The module's own traffic: N_OK good, N_INVALID invalid, N_UNAUTH tokenless Score calls."""
    s = np.load(exported[0] / "sample.npz")
    good = build_request(s["dense"][:EXAMPLES], to_rows(s["values"], s["lengths"])[:EXAMPLES])
    bad = build_request(s["dense"][:EXAMPLES], to_rows(s["values"], s["lengths"])[:EXAMPLES])
    bad.num_examples += 1
    md = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(gateway[0]) as ch:
        stub = ranker_pb2_grpc.RankerStub(ch)
        for _ in range(N_OK):
            stub.Score(good, metadata=md, timeout=10)
        for request, metadata, n in ((bad, md, N_INVALID), (good, (), N_UNAUTH)):
            for _ in range(n):
                with pytest.raises(grpc.RpcError):
                    stub.Score(request, metadata=metadata, timeout=10)


def test_endpoint_counts_the_tests_own_calls(
    gateway: tuple[str, int],
    calls: None,
    exported: tuple[Path, Path, str],
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
) -> None:
    got = gateway_metrics(gateway[1])

    def value(name: str, **labels: str) -> float:
        return got.get((f"recsys_gateway_{name}", tuple(sorted(labels.items()))), 0.0)

    assert value("requests_total", method=SCORE, code="OK") == N_OK
    assert value("requests_total", method=SCORE, code="INVALID_ARGUMENT") == N_INVALID
    assert value("requests_total", method=SCORE, code="UNAUTHENTICATED") == N_UNAUTH
    assert value("request_seconds_count", method=SCORE) == N_OK + N_INVALID + N_UNAUTH
    assert value("rejections_total", reason="invalid") == N_INVALID
    assert value("rejections_total", reason="unauthenticated") == N_UNAUTH
    assert value("examples_per_request_count") == N_OK
    assert value("examples_per_request_sum") == N_OK * EXAMPLES
    assert value("backend_call_examples_sum") == N_OK * EXAMPLES  # probes do not count
    assert value("backend_call_requests_sum") == N_OK
    assert value("in_flight_requests") == 0
    schema = Schema.load(exported[0] / "schema.json")
    info = {"model_name": schema.model_name, "model_version": schema.model_version}
    assert value("model_info", **info) == 1
    healthy = {
        dict(labels)["backend"]: v
        for (n, labels), v in got.items()
        if n == "recsys_gateway_backend_healthy"
    }
    assert sorted(healthy.values()) == [0.0, 1.0]  # the live TorchServe, the dead port
    assert healthy[torchserve[0].grpc_inference_target] == 1.0
    # what serves, per backend in rotation (issue 20): the handler's own word
    live = torchserve[0].grpc_inference_target
    serving = [dict(labels) for (n, labels), v in got.items()
               if n == "recsys_gateway_backend_serving_info" and v == 1]  # fmt: skip
    assert serving == [
        {"backend": live, "model_version": schema.model_version, "device": "cpu",
         "variant": "int8", "dtype": "int8"}
    ]  # fmt: skip


# --- a real Prometheus ------------------------------------------------------------------------


def prometheus_config(gateway_metrics: str, torchserve_metrics: str) -> str:
    return (
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        f"  - job_name: gateway\n    static_configs:\n      - targets: ['{gateway_metrics}']\n"
        f"  - job_name: torchserve\n    static_configs:\n      - targets: ['{torchserve_metrics}']\n"
    )


def query(base: str, promql: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as r:
        reply = json.loads(r.read())
    assert reply["status"] == "success", reply
    return list(reply["data"]["result"])


def wait_for(base: str, promql: str, timeout: float = 60) -> list[dict]:
    """The first non-empty result of ``promql`` (Prometheus scrapes every second)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if result := query(base, promql):
            return result
        time.sleep(0.5)
    raise AssertionError(f"Prometheus never returned {promql}")


@pytest.fixture()
def prometheus(
    gateway: tuple[str, int],
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
    tmp_path: Path,
) -> Iterator[str]:
    exe = shutil.which("prometheus")
    if exe is None:  # make test installs it (make test-deps): a missing tool fails, never skips
        pytest.fail("prometheus not found: run `make test-deps` (apt-get install prometheus)")
    cfg = tmp_path / "prometheus.yml"
    ts = torchserve[0]
    cfg.write_text(prometheus_config(f"127.0.0.1:{gateway[1]}", f"127.0.0.1:{ts.metrics_port}"))
    port = free_ports(1)[0]
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.monotonic() - t0 < 60, "Prometheus never became ready"
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_prometheus_scrapes_the_gateway_and_torchserve(
    prometheus: str, calls: None, gateway: tuple[str, int]
) -> None:
    ok = wait_for(prometheus, f'recsys_gateway_requests_total{{method="{SCORE}",code="OK"}}')
    assert [float(r["value"][1]) for r in ok] == [N_OK]
    assert ok[0]["metric"]["job"] == "gateway"
    up = wait_for(prometheus, 'up{job="torchserve"} == 1')
    assert len(up) == 1, "TorchServe's metrics API was not scraped"
    # a TorchServe metric of its own, moved by the requests above (and the gateway's probes)
    ts = wait_for(prometheus, 'ts_inference_requests_total{job="torchserve"} > 0')
    assert float(ts[0]["value"][1]) >= N_OK


def test_answers_say_what_scored_them(
    gateway: tuple[str, int],
    exported: tuple[Path, Path, str],
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
) -> None:
    """recsys.v1 answers name the backend and its device, variant and dtype in their trailing
    metadata (KServe v2's, in the response's parameters: tests/serving/test_kserve.py). Last in
    the module: its call is not one of the N_OK the counting tests expect."""
    s = np.load(exported[0] / "sample.npz")
    good = build_request(s["dense"][:3], to_rows(s["values"], s["lengths"])[:3])
    md = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(gateway[0]) as ch:
        _, call = ranker_pb2_grpc.RankerStub(ch).Score.with_call(good, metadata=md, timeout=10)
    headers = dict(call.trailing_metadata())
    assert headers["x-recsys-backend"] == torchserve[0].grpc_inference_target
    assert headers["x-recsys-served"] == "device=cpu variant=int8 dtype=int8"
