"""Logs are not amplifiers (issue 45): a client's garbage costs a few lines, files are rotated.

A TLS gateway with nothing behind it (the front doors are under test, not the scoring): 200
plaintext connections to its gRPC port, and malformed HTTP requests to its KServe REST port,
must each write a handful of lines, never one (or a traceback) per connection. grpc-core is run
both at the level ``python -m serving.gateway`` gives it (ERROR: its handshake line is INFO)
and at INFO, where the pump's per-kind limit alone holds. Then the gateway's log and
TorchServe's rotate by size, files bounded, and a restart appends a start mark.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recsys_stack.net import free_ports
from serving.gateway.config import MetricsConfig, TlsConfig
from serving.tools.supervisor import first_error
from tests.stack import running_torchserve, start_gateway, stop_gateway

pytestmark = pytest.mark.slow
PLAINTEXT = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0" * 30  # an HTTP/2 preface, no TLS
BAD_HTTP = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"


def log_text(log: Path) -> str:
    """The gateway's log, rotated files first (oldest first)."""
    rotated = sorted(log.parent.glob(log.name + ".*"), key=lambda p: -int(p.suffix[1:]))
    return "".join(p.read_text(errors="replace") for p in [*rotated, log] if p.exists())


def wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log_text(log):
        assert proc.poll() is None, f"the gateway exited: {log_text(log)[-3000:]}"
        assert time.monotonic() < deadline, f"{text!r} never logged: {log_text(log)[-3000:]}"
        time.sleep(0.2)


class Gateway:
    """A TLS gateway in front of a port where nothing listens; its gRPC and HTTP ports."""

    def __init__(self, schema: Path, certs: dict[str, Path], path: Path, **overrides: Any):
        self.log, grpc_dead, self.http = path, *free_ports(2)
        self.overrides = dict(
            backend=f"127.0.0.1:{grpc_dead}", key_file=str(path.with_name("no-key.json")),
            tls=TlsConfig(cert=str(certs["server.pem"]), key=str(certs["server.key"])),
            http_port=self.http, metrics=MetricsConfig(port=0), **overrides,
        )  # fmt: skip
        self.schema = schema
        self.start()

    def start(self) -> None:
        self.proc, target = start_gateway(self.schema, [], self.log, **self.overrides)
        self.port = int(target.rsplit(":", 1)[1])
        try:
            wait_for(self.log, f"gateway on 127.0.0.1:{self.port}", self.proc)
        except BaseException:
            self.proc.kill()  # never left running by a failed start
            raise

    def stop(self) -> None:
        assert stop_gateway(self.proc) == 0


def plaintext_connections(port: int, n: int) -> None:
    """``n`` connections sending HTTP/2 in the clear to a TLS port, each until it is closed."""
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(PLAINTEXT)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass


def bad_http_requests(port: int, n: int) -> list[bytes]:
    """``n`` requests over TLS with ``Content-Length: -1``; the status line of each answer."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    out = []
    for _ in range(n):
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=10)) as s:
            s.sendall(BAD_HTTP)
            out.append(s.recv(4096).split(b"\r\n")[0])
    return out


def size(log: Path) -> int:
    return len(log_text(log).encode())


@pytest.fixture(scope="module")
def gateway(
    exported: tuple[Path, Path, str],
    certs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Gateway]:
    """The gateway as ``make serve`` runs it (grpc-core's level left to the gateway)."""
    gw = Gateway(
        exported[0] / "schema.json", certs, tmp_path_factory.mktemp("logs") / "gateway.log"
    )
    try:
        yield gw
    finally:
        gw.stop()


def test_plaintext_to_the_tls_port_writes_almost_nothing(gateway: Gateway) -> None:
    before = size(gateway.log)
    plaintext_connections(gateway.port, 200)
    time.sleep(1)
    grown = size(gateway.log) - before
    print(f"200 plaintext connections: the log grew {grown} bytes")
    assert "Handshake failed" not in log_text(gateway.log)
    assert grown < 4000, log_text(gateway.log)[-3000:]


def test_malformed_http_is_one_line_per_kind_without_a_traceback(gateway: Gateway) -> None:
    start = len(log_text(gateway.log))
    answers = bad_http_requests(gateway.http, 50)
    assert set(answers) == {b"HTTP/1.0 400 Bad Request"}, set(answers)
    wait_for(gateway.log, "Error handling request from 127.0.0.1", gateway.proc)
    time.sleep(1)  # the rest, if any, reaches the file
    new = log_text(gateway.log)[start:]
    print(new[-2000:])
    assert "Traceback" not in new
    lines = [ln for ln in new.splitlines() if "Error handling request" in ln]
    assert 1 <= len(lines) <= 10, lines  # log.per_kind: 10 a minute
    assert all(" WARNING aiohttp.server: " in ln and "BadHttpMessage 400" in ln for ln in lines)


def test_grpc_core_at_info_is_rate_limited_by_the_pump(
    exported: tuple[Path, Path, str],
    certs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """grpc-core at INFO writes one line per failed handshake: the pump writes 10 of them and
    one line counting the rest."""
    monkeypatch.setenv("GRPC_VERBOSITY", "INFO")  # the gateway inherits it
    gw = Gateway(exported[0] / "schema.json", certs, tmp_path / "gateway.log")
    try:
        before = size(gw.log)
        plaintext_connections(gw.port, 200)
        wait_for(gw.log, "Handshake failed", gw.proc)
    finally:
        gw.stop()  # the pump writes what it counted when the gateway exits
    grown, text = size(gw.log) - before, log_text(gw.log)
    print(f"200 plaintext connections, grpc-core at INFO: the log grew {grown} bytes")
    lines = [ln for ln in text.splitlines() if "Handshake failed" in ln]
    written = [ln for ln in lines if "logpump: suppressed" not in ln]
    assert 1 <= len(written) <= 10, written
    assert len(lines) > len(written), "no line counted the suppressed ones"
    assert grown < 8000, text[-3000:]


def test_the_gateway_log_rotates_and_a_restart_appends_a_mark(
    exported: tuple[Path, Path, str],
    certs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from serving.gateway.config import GatewayLogConfig  # (the test fails, not the module)

    monkeypatch.setenv("GRPC_VERBOSITY", "INFO")  # one line per connection: volume to rotate
    log = tmp_path / "gateway.log"
    cap = 8 * 1024
    gw = Gateway(exported[0] / "schema.json", certs, log,
                 log=GatewayLogConfig(max_mb=cap / 2**20, files=2, per_kind=0))  # fmt: skip
    try:
        plaintext_connections(gw.port, 200)  # ~40 KB of lines
        wait_for(log, "Handshake failed", gw.proc)
    finally:
        gw.stop()
    files = sorted(p.name for p in tmp_path.glob("gateway.log*"))
    assert files == ["gateway.log", "gateway.log.1"], files  # rotated, two kept
    assert all((tmp_path / f).stat().st_size <= cap for f in files)
    last = log.read_text().splitlines()[-1]
    gw.start()
    try:
        wait_for(log, f"==== gateway start: pid {gw.proc.pid},", gw.proc)
    finally:
        gw.stop()
    text = log_text(log)
    assert text.index(last) < text.index(f"==== gateway start: pid {gw.proc.pid},")


def test_first_error_reads_a_rotated_log_from_its_start(tmp_path: Path) -> None:
    """The supervisor remembers the log's size before a start; a rotation since makes it
    shorter: the error is read from the new file's start."""
    log = tmp_path / "gateway.log"
    log.write_text("2026-12-05 ==== gateway start: pid 1\nerror: schema x: missing\n")
    assert first_error(log, offset=10_000_000) == "schema x: missing"


def test_torchserve_log_rotates_with_a_start_mark(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    from recsys_stack.logpump import LogConfig

    cap = 512
    rotation = LogConfig(max_mb=cap / 2**20, files=50, per_kind=0)
    with running_torchserve(exported[1], tmp_path / "ts", log=rotation) as (cfg, proc):
        files = list(cfg.workdir.glob("torchserve.log*"))
        text = log_text(cfg.log_file)
    assert len(files) > 1, "TorchServe's startup did not rotate a 512-byte log"
    longest = max(len(ln) + 1 for ln in text.encode().splitlines())
    assert all(p.stat().st_size <= max(cap, longest) for p in files)
    assert f"==== torchserve start: pid {proc.pid}," in text
