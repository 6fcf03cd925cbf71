"""The metrics endpoint is not an open door nor an amplifier (issue 45): loopback by default,
a bearer token when one is set, one render per second however many scrape.

The endpoint itself in this process (its renders counted on the registry), then a real gateway
bound to every address (a container's ``host = 0.0.0.0``) with the metrics left at their
default bind, a metrics token and the gateway's own token file.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from recsys_stack.net import free_ports
from serving.gateway import metrics
from serving.gateway.config import AuthConfig, MetricsConfig
from tests.stack import start_gateway, stop_gateway

METRICS_TOKEN = "metrics-token-" + "m" * 20
SCORING_TOKEN = "scoring-token-" + "s" * 20


def scrape(port: int, token: str | None = None, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """(HTTP status, body) of ``GET /metrics``; (0, b"") when nothing answers."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"http://{host}:{port}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except urllib.error.URLError:
        return 0, b""


def until(what: str, check: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened within {timeout:.0f} s: {what}"
        time.sleep(0.1)


def counted_renders(m: metrics.GatewayMetrics) -> list[int]:
    """A counter of the registry's renders (every exposition collects the registry once)."""
    calls = [0]
    collect = m.registry.collect

    def counting() -> Any:
        calls[0] += 1
        return collect()

    m.registry.collect = counting  # type: ignore[method-assign]
    return calls


def test_a_scrape_without_the_token_is_401(tmp_path: Path) -> None:
    token_file = tmp_path / "metrics_token"
    token_file.write_text(METRICS_TOKEN + "\n")
    m = metrics.configure(10, 10)
    renders = counted_renders(m)
    server = metrics.start_server(m, "127.0.0.1", free_ports(1)[0], str(token_file), 0.0)
    assert server is not None
    try:
        assert scrape(server.port)[0] == 401
        assert scrape(server.port, "wrong-" + METRICS_TOKEN)[0] == 401
        assert renders[0] == 0  # a refused scrape costs no render
        status, body = scrape(server.port, METRICS_TOKEN)
        assert status == 200 and b"recsys_gateway_requests" in body
        token_file.write_text("")  # emptied: every scrape refused (fail closed)
        until("the emptied file refuses", lambda: scrape(server.port, METRICS_TOKEN)[0] == 401)
        token_file.write_text(f"# rotated\n{METRICS_TOKEN}-2\n")
        until(
            "the new token is accepted", lambda: scrape(server.port, f"{METRICS_TOKEN}-2")[0] == 200
        )
    finally:
        server.close()


def test_concurrent_scrapes_render_once_a_second() -> None:
    """48 scrapers at once (the default cache_s, 1 s): one render for each second they took."""
    m = metrics.configure(10, 10)
    renders = counted_renders(m)
    server = metrics.start_server(m, "127.0.0.1", free_ports(1)[0])
    assert server is not None
    n, answers = 48, []
    start = threading.Barrier(n + 1)

    def one() -> None:
        start.wait()
        answers.append(scrape(server.port))

    try:
        threads = [threading.Thread(target=one) for _ in range(n)]
        for t in threads:
            t.start()
        start.wait()
        t0 = time.monotonic()
        for t in threads:
            t.join(120)
        took = time.monotonic() - t0
    finally:
        server.close()
    print(f"{n} concurrent scrapes in {took:.2f} s: {renders[0]} renders")
    assert [a[0] for a in answers] == [200] * n
    assert renders[0] <= 1 + int(took), f"{n} scrapes in {took:.2f} s rendered {renders[0]} times"


def test_the_render_is_fresh_after_cache_s() -> None:
    m = metrics.configure(10, 10)
    renders = counted_renders(m)
    server = metrics.start_server(m, "127.0.0.1", free_ports(1)[0], cache_s=0.2)
    assert server is not None
    try:
        scrape(server.port)
        m.rejections["invalid"].inc()
        time.sleep(0.3)
        assert b'recsys_gateway_rejections_total{reason="invalid"} 1.0' in scrape(server.port)[1]
        assert renders[0] == 2
    finally:
        server.close()


# --- a real gateway on every address -------------------------------------------------------


@pytest.fixture(scope="module")
def exposed(
    exported: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, int, Path]]:
    """(gateway process, metrics port, folder) of a gateway on 0.0.0.0 whose metrics keep
    their default bind, with a metrics token and a scoring token file."""
    work = tmp_path_factory.mktemp("exposed")
    (work / "metrics_token").write_text(METRICS_TOKEN + "\n")
    (work / "gateway_token").write_text(SCORING_TOKEN + "\n")
    dead, http, port = free_ports(3)
    proc, _ = start_gateway(
        exported[0] / "schema.json", [], work / "gateway.log", host="0.0.0.0",
        backend=f"127.0.0.1:{dead}", key_file=str(work / "no-key.json"), http_port=http,
        auth=AuthConfig(token_file=str(work / "gateway_token")),
        metrics=MetricsConfig(port=port, token_file=str(work / "metrics_token")),
    )  # fmt: skip
    try:
        until("the metrics answer", lambda: scrape(port, METRICS_TOKEN)[0] == 200, timeout=120)
        yield proc, port, work
    finally:
        assert stop_gateway(proc) == 0


def test_metrics_bind_loopback_by_default(exposed: tuple[Any, int, Path]) -> None:
    assert MetricsConfig().host == "127.0.0.1"
    proc, port, _ = exposed
    bound = [
        c.laddr.ip
        for c in psutil.Process(proc.pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert bound == ["127.0.0.1"], bound  # not the gateway's 0.0.0.0
    others = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    for address in others:  # this machine's other addresses do not reach it
        with pytest.raises(OSError):
            socket.create_connection((address, port), timeout=5).close()


def test_the_gateway_metrics_need_their_token_and_show_no_secret_path(
    exposed: tuple[Any, int, Path],
) -> None:
    _, port, work = exposed
    assert scrape(port)[0] == 401
    assert scrape(port, SCORING_TOKEN)[0] == 401  # the scoring token is not the metrics'
    status, body = scrape(port, METRICS_TOKEN)
    assert status == 200
    text = body.decode()
    assert str(work) not in text, [ln for ln in text.splitlines() if str(work) in ln]
    assert 'recsys_gateway_auth_token_file_ok{token_file="gateway_token"} 1.0' in text
