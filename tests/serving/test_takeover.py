"""A gateway takeover under load, repeated: a second gateway binds the same port (grpc sets
SO_REUSEPORT on Linux), says SERVING, and the first gets SIGTERM (graceful stop), as
``loadtest/faults.py``'s ``gateway-takeover`` does. Clients call back to back through the
project's own channel (:func:`serving.tools.channel.open_channel`, what Locust, ``make score``
and the supervisor use); no call may fail.

Without the channel's retry policy this fails in most takeovers: grpc core CANCELs the calls it
has received but not yet handed to the old server's Python code when ``server.stop`` begins
(grpc/grpc#41785), and a reconnect that lands in the old listener's accept queue is reset and
fails calls fast UNAVAILABLE for the 1 s reconnect backoff (docs/chaos.md, "takeover").
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recsys_stack.net import free_ports
from serving.gateway.config import GatewayConfig, MetricsConfig
from serving.stubs import ranker_pb2_grpc
from serving.tools.channel import open_channel
from serving.tools.client import build_request
from serving.tools.supervisor import launch_gateway
from serving.torchserve.config import TorchServeConfig
from serving.worker.codec import to_rows

TAKEOVERS = 8
SCORERS = 4  # Score callers (each its own channel, as each Locust user has)
CHECKERS = 8  # health callers: cheap calls, so many arrive in the instant the old one stops
SERVING_LINE = "gateway is SERVING"
START_TIMEOUT_S = 120.0


@dataclasses.dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    log: Path


def start(cfg: GatewayConfig, log: Path) -> Gateway:
    """A gateway for ``cfg``, once its own log says SERVING (a health call could reach either
    of two gateways on one port)."""
    gw = Gateway(launch_gateway(cfg, log), log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (log.exists() and SERVING_LINE in log.read_text(errors="replace")):
        assert gw.proc.poll() is None, f"gateway exited {gw.proc.returncode}: {log.read_text()}"
        assert time.monotonic() < deadline, f"gateway not SERVING after {START_TIMEOUT_S:g} s"
        time.sleep(0.1)
    return gw


class Callers:
    """Threads calling back to back until stopped; failures by code, with their details."""

    def __init__(self, target: str, calls: list[Callable[[grpc.Channel], Any]]) -> None:
        self.target = target
        self.ok = 0
        self.failed: Counter[str] = Counter()
        self.details: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(c,), daemon=True) for c in calls]

    def run(self, call: Callable[[grpc.Channel], Any]) -> None:
        with open_channel(self.target) as channel:
            while not self.stop.is_set():
                try:
                    call(channel)
                    with self.lock:
                        self.ok += 1
                except grpc.RpcError as e:
                    with self.lock:
                        self.failed[e.code().name] += 1
                        self.details.append(f"{e.code().name}: {e.details()}")

    def wait_ok(self, more: int, timeout: float = 60.0) -> None:
        """Until ``more`` further calls succeeded (the clients are calling)."""
        want, deadline = self.ok + more, time.monotonic() + timeout
        while self.ok < want:
            assert time.monotonic() < deadline, f"only {self.ok} calls answered: {self.failed}"
            time.sleep(0.05)


@contextlib.contextmanager
def running(callers: Callers) -> Iterator[Callers]:
    for t in callers.threads:
        t.start()
    try:
        yield callers
    finally:
        callers.stop.set()
        for t in callers.threads:
            t.join(timeout=30)


def test_calls_through_our_channel_survive_repeated_takeovers(
    exported: tuple[Path, Path, str],
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    export, _, _ = exported
    ts, _ = torchserve
    cfg = GatewayConfig(
        schema=export / "schema.json",
        port=free_ports(1)[0],
        backend=ts.grpc_inference_target,
        key_file=str(ts.key_file),
        metrics=MetricsConfig(port=0),  # two gateways at once: no second metrics port
    )
    s = np.load(export / "sample.npz")
    request = build_request(s["dense"][:10], to_rows(s["values"], s["lengths"])[:10])
    check = health_pb2.HealthCheckRequest()

    def score(channel: grpc.Channel) -> Any:
        return ranker_pb2_grpc.RankerStub(channel).Score(request, timeout=10)

    def healthy(channel: grpc.Channel) -> Any:
        return health_pb2_grpc.HealthStub(channel).Check(check, timeout=10)

    gateways = [start(cfg, tmp_path / "gateway-0.log")]
    calls = [score] * SCORERS + [healthy] * CHECKERS
    failed_takeovers = 0
    try:
        with running(Callers(f"127.0.0.1:{cfg.port}", calls)) as callers:
            callers.wait_ok(200)
            for k in range(1, TAKEOVERS + 1):
                before = sum(callers.failed.values())
                new = start(cfg, tmp_path / f"gateway-{k}.log")
                callers.wait_ok(50)  # both gateways take calls
                old = gateways[-1]
                gateways.append(new)
                old.proc.send_signal(signal.SIGTERM)
                assert old.proc.wait(timeout=cfg.grace_s + 30) == 0, "graceful stop exits 0"
                callers.wait_ok(200)  # the callers go on, on the new gateway
                failed_takeovers += sum(callers.failed.values()) > before
    finally:
        for gw in gateways:
            if gw.proc.poll() is None:
                gw.proc.send_signal(signal.SIGTERM)
                gw.proc.wait(timeout=cfg.grace_s + 30)
    print(f"{callers.ok} calls answered, failed {dict(callers.failed)} in {failed_takeovers} "
          f"of {TAKEOVERS} takeovers")  # fmt: skip
    assert not callers.failed, (
        f"{sum(callers.failed.values())} calls failed in {failed_takeovers} of {TAKEOVERS} "
        f"takeovers: {dict(callers.failed)}; first: {callers.details[:3]}"
    )


def _score_count(metrics_port: int) -> float:
    """Score calls a gateway answered OK, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("recsys_gateway_requests_total{")
        and '/Score"' in line
        and 'code="OK"' in line
    )


def test_two_gateways_restarted_in_turn_fail_no_call(
    exported: tuple[Path, Path, str],
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    """Issue 50: two gateways, the clients' channel naming both (round robin, as
    ``dns:///gateway:50051`` names every replica); each gateway stopped (SIGTERM: NOT_SERVING,
    GOAWAY, its calls finish), left down a second, started again, in turn, twice each: no
    call fails, and both gateways take calls (the calls are spread, not all on one)."""
    export, _, _ = exported
    ts, _ = torchserve
    ports = free_ports(4)
    cfgs = [
        GatewayConfig(
            schema=export / "schema.json",
            port=ports[i],
            backend=ts.grpc_inference_target,
            key_file=str(ts.key_file),
            metrics=MetricsConfig(port=ports[2 + i]),
        )
        for i in range(2)
    ]
    s = np.load(export / "sample.npz")
    request = build_request(s["dense"][:10], to_rows(s["values"], s["lengths"])[:10])

    def score(channel: grpc.Channel) -> Any:
        return ranker_pb2_grpc.RankerStub(channel).Score(request, timeout=10)

    logs = iter(range(100))
    gateways = [start(c, tmp_path / f"gateway-{next(logs)}.log") for c in cfgs]
    target = f"ipv4:127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    try:
        with running(Callers(target, [score] * SCORERS)) as callers:
            callers.wait_ok(200)
            for _ in range(2):  # (3 rounds: 125 s of a busy suite's critical path)
                for i, cfg in enumerate(cfgs):
                    gateways[i].proc.send_signal(signal.SIGTERM)
                    assert gateways[i].proc.wait(timeout=cfg.grace_s + 30) == 0
                    callers.wait_ok(50)  # the other gateway alone
                    time.sleep(1.0)
                    gateways[i] = start(cfg, tmp_path / f"gateway-{next(logs)}.log")
                    callers.wait_ok(200)
            answered = [_score_count(c.metrics.port) for c in cfgs]  # since their last start
    finally:
        for gw in gateways:
            if gw.proc.poll() is None:
                gw.proc.send_signal(signal.SIGTERM)
                gw.proc.wait(timeout=30)
    print(f"{callers.ok} calls answered, failed {dict(callers.failed)}; the last two gateways "
          f"answered {answered}")  # fmt: skip
    assert not callers.failed, f"{dict(callers.failed)}; first: {callers.details[:3]}"
    assert min(answered) > 0, f"one gateway took no call after its restart: {answered}"
