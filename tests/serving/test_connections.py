"""Connections as a resource (serving/gateway/connections.py), against real gateways in front
of no TorchServe (NOT_SERVING answers: reached; health and ``/v2/health/live`` need no backend).

One TLS gateway for the module, started with a soft open-files limit of 1,024, short idle and
handshake times and small caps: it raised its limit, closes an idle HTTP/2 connection and a
silent one on both TLS ports, closes a gRPC connection over its cap, and refuses HTTP
connections over the per-peer and total caps (sources 127.0.0.2 and .3 are other peers) while
those within answer. Then a gateway whose hard limit is 96 descriptors, with no caps: accept()
fails with EMFILE, logged as one line per 10 s, and it answers again once connections close.
"""

from __future__ import annotations

import json
import resource
import socket
import ssl
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recsys_stack.logs import OncePer
from recsys_stack.net import free_ports
from serving.gateway.config import (
    ChannelConfig,
    ConnectionsConfig,
    GatewayConfig,
    MetricsConfig,
    TlsConfig,
)
from serving.gateway.connections import fit, grpc_options
from serving.gateway.validate import Limits
from serving.tools.supervisor import as_overrides
from tests.conftest import ROOT
from tests.stack import stop_gateway, wait_status

IDLE_S, HANDSHAKE_S = 1.5, 2.0
GRPC_MAX, HTTP_MAX, HTTP_PER_PEER = 4, 3, 2
BOUND_S = 30.0  # "closed" = within this; grpc's defaults: never (idle), 120 s (handshake)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
GOAWAY, PING, SETTINGS = 7, 6, 4
# the gateway under a given RLIMIT_NOFILE (set here, then exec: no preexec_fn in a threaded test)
LIMITED = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
           "(int(sys.argv[1]), int(sys.argv[2]))); "
           "os.execv(sys.executable, [sys.executable, '-m', 'serving.gateway', *sys.argv[3:]])")  # fmt: skip


def _until(what: Callable[[], Any], timeout: float, why: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := what()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{why} within {timeout:.0f} s")
        time.sleep(0.1)
    return got


def launch_limited(cfg: GatewayConfig, log: Path, soft: int, hard: int) -> subprocess.Popen[bytes]:
    """The gateway for ``cfg`` started with open-files limits (``soft``, ``hard``)."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", LIMITED, str(soft), str(hard), *as_overrides(cfg)], cwd=ROOT,
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def gateway_cfg(d: Path, **overrides: Any) -> GatewayConfig:
    """A gateway on free ports in front of no TorchServe."""
    (d / "schema.json").write_text(json.dumps({"model": {"name": "m", "version": "1"},
                                               "features": {"dense": ["I1"], "sparse": ["C1"]}}))  # fmt: skip
    (d / "keys.json").write_text('{"inference": {"key": "k"}, "management": {"key": "m"}}')
    port, http, nobody = free_ports(3)
    return GatewayConfig(
        schema=d / "schema.json", port=port, http_port=http, backend=f"127.0.0.1:{nobody}",
        key_file=str(d / "keys.json"), metrics=MetricsConfig(port=0), **overrides,
    )  # fmt: skip


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    cfg: GatewayConfig
    log: Path
    ca: Path

    def tls(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        return ctx


@pytest.fixture(scope="module")
def gateway(certs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    d = tmp_path_factory.mktemp("conn")
    caps = ConnectionsConfig(
        grpc_idle_s=IDLE_S, handshake_timeout_s=HANDSHAKE_S, grpc_max_connections=GRPC_MAX,
        http_max_connections=HTTP_MAX, http_max_per_peer=HTTP_PER_PEER,
    )  # fmt: skip
    cfg = gateway_cfg(
        d, connections=caps, limits=Limits(read_timeout_s=120),  # held HTTP connections stay
        tls=TlsConfig(cert=str(certs["server.pem"]), key=str(certs["server.key"])),
    )  # fmt: skip
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = launch_limited(cfg, d / "gateway.log", min(1024, hard), hard)
    gw = Gateway(proc, cfg, d / "gateway.log", certs["ca.pem"])
    try:
        wait_status(f"127.0.0.1:{cfg.port}", "NOT_SERVING", 120, ChannelConfig(tls_ca=str(gw.ca)))
        _until(lambda: _get_live(gw) == 200, 60, "no answer on the HTTP port")
        yield gw
    finally:
        assert stop_gateway(proc) == 0
        print(gw.log.read_text()[-3000:])


# --- raw connections --------------------------------------------------------------------


def _connect(port: int, ctx: ssl.SSLContext | None = None, src: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(src, 0))
    return ctx.wrap_socket(s, server_hostname="localhost") if ctx is not None else s


def _frame(kind: int, flags: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags, 0, 0, 0, 0]) + payload


def _h2_until_closed(s: socket.socket, limit: float) -> tuple[float | None, list[int]]:
    """(seconds until the gateway closed ``s``, None = still open after ``limit``; the frame
    types it sent), answering SETTINGS and PING as a client does."""
    t0, buf, kinds = time.monotonic(), b"", list[int]()
    s.settimeout(0.5)
    while time.monotonic() - t0 < limit:
        try:
            data = s.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset
            return time.monotonic() - t0, kinds
        if not data:
            return time.monotonic() - t0, kinds
        buf += data
        while len(buf) >= 9 and len(buf) >= 9 + (n := int.from_bytes(buf[:3], "big")):
            kind, flags, payload, buf = buf[3], buf[4], buf[9 : 9 + n], buf[9 + n :]
            kinds.append(kind)
            if kind in (SETTINGS, PING) and not flags & 1:  # ACK them
                s.sendall(_frame(kind, 1, payload if kind == PING else b""))
    return None, kinds


def _closed_within(s: socket.socket, limit: float) -> float | None:
    """Seconds until the peer closes ``s`` sending nothing more; None = open after ``limit``."""
    t0 = time.monotonic()
    s.settimeout(limit)
    try:
        data = s.recv(1 << 16)
    except TimeoutError:
        return None
    except OSError:
        data = b""
    assert not data, data[:100]
    return time.monotonic() - t0


def _get_live(gw: Gateway, s: socket.socket | None = None) -> int:
    """Status of ``GET /v2/health/live`` on ``s`` (kept open), else on a new connection; 0 when
    the gateway closes or refuses it."""
    try:
        if s is None:
            with _connect(gw.cfg.http_port, gw.tls()) as fresh:
                return _get_live(gw, fresh)
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: gw\r\n\r\n")
        s.settimeout(10)
        head = s.recv(65536)
    except OSError:
        return 0
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else 0


def _refused(gw: Gateway, src: str) -> bool:
    """A connection from ``src`` is closed before its TLS handshake ends, or with no answer."""
    try:
        s = _connect(gw.cfg.http_port, gw.tls(), src)
    except OSError:  # reset or EOF in the handshake (ssl.SSLError is an OSError)
        return True
    with s:
        return _get_live(gw, s) == 0


# --- the module's TLS gateway -----------------------------------------------------------------


def test_gateway_raises_its_soft_open_files_limit_to_the_hard_one(gateway: Gateway) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard <= 1024:
        pytest.skip(f"the hard open-files limit is {hard}: nothing to raise 1,024 to")
    line = next(ln for ln in Path(f"/proc/{gateway.proc.pid}/limits").read_text().splitlines()
                if ln.startswith("Max open files"))  # fmt: skip
    soft_now, hard_now = (int(w) for w in line.split()[3:5])
    assert (soft_now, hard_now) == (hard, hard), line
    want = f"open files limit raised from 1024 to {hard}"
    deadline = time.monotonic() + 60  # the log pump (a process of its own) writes it in its time
    while want not in gateway.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert want in gateway.log.read_text()


def test_an_idle_grpc_connection_is_closed_with_goaway(gateway: Gateway) -> None:
    with _connect(gateway.cfg.port, gateway.tls()) as s:
        assert isinstance(s, ssl.SSLSocket) and s.selected_alpn_protocol() == "h2"
        s.sendall(PREFACE + _frame(SETTINGS, 0))
        took, kinds = _h2_until_closed(s, BOUND_S)
    assert took is not None, f"an idle connection lived {BOUND_S:.0f} s (grpc_idle_s {IDLE_S})"
    assert took >= IDLE_S * 0.6 and GOAWAY in kinds, (took, kinds)


@pytest.mark.parametrize("sent", [b"", b"\x16\x03\x01"], ids=["silent", "half-a-record"])
@pytest.mark.parametrize("port", ["grpc", "http"])
def test_a_connection_that_never_finishes_its_tls_handshake_is_closed(
    gateway: Gateway, port: str, sent: bytes
) -> None:
    with _connect(gateway.cfg.port if port == "grpc" else gateway.cfg.http_port) as s:
        s.sendall(sent)
        took = _closed_within(s, BOUND_S)
    # before: grpc's 120 s, asyncio's 60 s
    assert took is not None, f"open after {BOUND_S:.0f} s (handshake_timeout_s {HANDSHAKE_S})"
    assert took >= HANDSHAKE_S * 0.6, took


def _check(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return,attr-defined]
    return grpc.StatusCode.OK


def test_a_grpc_connection_over_the_cap_is_closed_and_one_under_it_is_served(
    gateway: Gateway,
) -> None:
    creds = grpc.ssl_channel_credentials(gateway.ca.read_bytes())
    target = f"127.0.0.1:{gateway.cfg.port}"
    # a connection of its own per channel (grpc shares them by default); Watch keeps a call
    # open on each, so grpc_idle_s does not close them
    own = [("grpc.use_local_subchannel_pool", 1)]
    held, watches = [], []
    try:
        for _ in range(GRPC_MAX):
            ch = grpc.secure_channel(target, creds, options=own)
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            held.append(ch)
            watches.append(watch)
        with grpc.secure_channel(target, creds, options=own) as extra:
            assert _check(extra) == grpc.StatusCode.UNAVAILABLE  # before: OK (no cap)
        watches.pop().cancel()
        held.pop().close()
        with grpc.secure_channel(target, creds, options=own) as extra:
            _until(lambda: _check(extra) == grpc.StatusCode.OK, 60, "no room after a close")
    finally:
        for w in watches:
            w.cancel()
        for ch in held:
            ch.close()


def test_http_connections_over_the_per_peer_and_total_caps_are_refused(gateway: Gateway) -> None:
    tls = gateway.tls()
    first = [_connect(gateway.cfg.http_port, tls) for _ in range(HTTP_PER_PEER)]
    others: list[socket.socket] = []
    try:
        assert [_get_live(gateway, s) for s in first] == [200] * HTTP_PER_PEER
        assert _refused(gateway, "127.0.0.1")  # per peer (before: 200)
        others.append(_connect(gateway.cfg.http_port, tls, "127.0.0.2"))
        assert _get_live(gateway, others[0]) == 200
        assert _refused(gateway, "127.0.0.3")  # in total
        assert [_get_live(gateway, s) for s in first + others] == [200] * HTTP_MAX
        first.pop().close()  # room for one more from 127.0.0.1
        _until(lambda: _get_live(gateway) == 200, 60, "no room after a close")
    finally:
        for s in first + others:
            s.close()


# --- out of descriptors ---------------------------------------------------------------------


def _accept_lines(log: Path) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if "out of system resource" in ln]


def _http_live(port: int) -> int:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: gw\r\n\r\n")
            head = s.recv(65536)
    except OSError:
        return 0
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else 0


def test_accept_out_of_descriptors_is_one_line_per_10_s_and_the_gateway_recovers(
    tmp_path: Path,
) -> None:
    off = ConnectionsConfig(grpc_max_connections=0, http_max_connections=0, http_max_per_peer=0)
    cfg = gateway_cfg(tmp_path, connections=off, limits=Limits(read_timeout_s=120))
    log = tmp_path / "gateway.log"
    proc = launch_limited(cfg, log, 96, 96)  # ~20 in use once started
    held: list[socket.socket] = []
    try:
        wait_status(f"127.0.0.1:{cfg.port}", "NOT_SERVING", 120)
        for _ in range(150):  # beyond the limit; the rest wait in the listen backlog
            held.append(socket.create_connection(("127.0.0.1", cfg.http_port), timeout=10))
        first = _until(lambda: _accept_lines(log), 60, "no accept failure logged")
        assert "Too many open files" in first[0] and "open files limit 96" in first[0], first
        # asyncio retries every second: 10 s give ~10 failures, then one more line counting them
        two = _until(lambda: len(got := _accept_lines(log)) >= 2 and got, 60, "no second line")
        assert "more since the last line" in two[1], two  # before: a traceback each second
        # (grpc logs a traceback per failed connect to the backend: not the accept loop's)
        assert len(_accept_lines(log)) == 2 and "_accept_connection" not in log.read_text()
        for s in held:
            s.close()
        _until(lambda: _http_live(cfg.http_port) == 200, 60, "no answer once connections closed")
    finally:
        for s in held:
            s.close()
        assert stop_gateway(proc) == 0
        print(log.read_text()[-3000:])


# --- the parts without a gateway ------------------------------------------------------------


def test_grpc_options_name_each_key_in_milliseconds_and_leave_zero_at_grpcs_default() -> None:
    got = dict(grpc_options(ConnectionsConfig(grpc_idle_s=0, grpc_max_streams=0)))
    assert got == {
        "grpc.max_connection_age_ms": 600_000,
        "grpc.max_connection_age_grace_ms": 30_000,
        "grpc.server_handshake_timeout_ms": 10_000,
        "grpc.max_allowed_incoming_connections": 4096,
    }


def test_caps_over_the_open_files_limit_are_lowered_to_fit() -> None:
    caps = ConnectionsConfig(grpc_max_connections=3000, http_max_connections=1000,
                             http_max_per_peer=900)  # fmt: skip
    assert fit(caps, 20000) == caps
    small = fit(caps, 1024 + 256)
    assert small.grpc_max_connections + small.http_max_connections <= 1024
    assert (small.grpc_max_connections, small.http_max_connections) == (768, 256)
    assert small.http_max_per_peer == 256
    assert fit(caps, 1024 + 256, http=False).grpc_max_connections == 1024
    off = ConnectionsConfig(grpc_max_connections=0)
    assert fit(off, 300) == off  # no cap: nothing to fit


def test_once_per_lets_one_line_through_per_period_and_counts_the_rest() -> None:
    now = [0.0]
    once = OncePer(10.0, clock=lambda: now[0])
    assert once.ready() == 0
    assert [once.ready() for _ in range(5)] == [None] * 5
    now[0] = 10.0
    assert once.ready() == 5 and once.ready() is None
