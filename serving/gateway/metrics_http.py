"""The gateway's ``GET /metrics`` endpoint: loopback by default, a bearer token, one render a second.

prometheus_client's ``start_http_server`` rendered the whole registry for every scrape, on a
new thread each, in the gateway's process: 64 scrapers cut the other clients' calls by 57%
(each render holds the GIL the event loop needs), and it took no token. Here:

- the rendered text is kept ``cache_s`` (1 s): one render per second however many scrape, the
  others wait for it and share it;
- at most :data:`MAX_HANDLERS` requests are handled at once (more wait in the listen queue) and a
  connection that sends nothing for :data:`TIMEOUT_S` is closed: scrapers cannot hold threads;
- with a token file, a scrape without ``Authorization: Bearer <token>`` gets 401 and costs no
  render; the file is re-read when it changes (an emptied or unreadable one refuses every
  scrape: fail closed);
- no line is logged per request (http.server writes one to stderr by default: an amplifier).

The bind address is :class:`~serving.gateway.config.MetricsConfig`'s ``host`` (127.0.0.1 by
default); exposing it is a deliberate setting, warned about when it has no token.
"""

from __future__ import annotations

import hmac
import http.server
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

logger = logging.getLogger("serving.gateway.metrics")
MAX_HANDLERS = 4
TIMEOUT_S = 5.0
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class MetricsTokenError(ValueError):
    """The metrics token file cannot be used (missing, unreadable, no token in it)."""


def read_tokens(path: str | Path) -> list[str]:
    """The tokens of a metrics token file: its lines, stripped, blank and ``#`` lines aside
    (a file Prometheus reads as ``credentials_file`` holds the token alone)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise MetricsTokenError(f"metrics token file {path}: {e.strerror or e}") from None
    tokens = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    if not tokens:
        raise MetricsTokenError(f"metrics token file {path}: no token in it")
    return tokens


class Tokens:
    """The accepted tokens, re-read when the file's identity (inode, size, mtime) changes,
    looked at at most once a second; a file that cannot be used is logged once per change."""

    def __init__(self, path: str) -> None:
        self.path, self.lock = path, threading.Lock()
        self.seen: object = None
        self.tokens: list[bytes] = []
        self.checked = float("-inf")

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
            seen: object = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError as e:
            seen = e.errno
        if seen == self.seen:
            return
        self.seen = seen
        try:
            self.tokens = [t.encode() for t in read_tokens(self.path)]
        except MetricsTokenError as e:
            self.tokens = []  # fail closed
            logger.error("%s: every scrape refused until it is fixed", e)

    def accepts(self, header: str | None) -> bool:
        """Whether ``header`` (an Authorization value) carries one of the tokens."""
        with self.lock:
            if time.monotonic() - self.checked >= 1.0:
                self.checked = time.monotonic()
                self._refresh()
            tokens = self.tokens
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return False
        return any(hmac.compare_digest(given.strip().encode(), t) for t in tokens)


class Rendered:
    """The registry's text, rendered at most once per ``cache_s``; ``renders`` counts them."""

    def __init__(self, registry: CollectorRegistry, cache_s: float) -> None:
        self.registry, self.cache_s = registry, cache_s
        self.lock = threading.Lock()
        self.text, self.at, self.renders = b"", float("-inf"), 0

    def get(self) -> bytes:
        with self.lock:  # concurrent scrapes wait for the one render, then share it
            if time.monotonic() - self.at >= self.cache_s or not self.renders:
                self.text = generate_latest(self.registry)
                self.at, self.renders = time.monotonic(), self.renders + 1
            return self.text


class _Handler(http.server.BaseHTTPRequestHandler):
    server: MetricsHTTPServer
    timeout = TIMEOUT_S  # a connection that sends nothing is closed
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        srv = self.server
        if self.path.split("?")[0] not in ("/metrics", "/"):
            return self._reply(404, b"not found: GET /metrics\n", "text/plain")
        if srv.tokens is not None and not srv.tokens.accepts(self.headers.get("Authorization")):
            return self._reply(401, b"unauthorized: send Authorization: Bearer <token>\n",
                               "text/plain", {"WWW-Authenticate": 'Bearer realm="metrics"'})  # fmt: skip
        self._reply(200, srv.rendered.get(), CONTENT_TYPE_LATEST)

    def _reply(
        self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(code)
        for k, v in {
            "Content-Type": ctype,
            "Content-Length": str(len(body)),
            **(headers or {}),
        }.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # http.server's names
        pass  # one line per scrape on stderr would make every scraper a log writer

    def log_error(self, format: str, *args: Any) -> None:
        pass


class MetricsHTTPServer(http.server.ThreadingHTTPServer):
    """A thread per request, at most :data:`MAX_HANDLERS` at once."""

    daemon_threads = True
    request_queue_size = 128  # socketserver's 5 dropped the 6th concurrent connect: a 1 s retry

    def __init__(self, address: tuple[str, int], rendered: Rendered, tokens: Tokens | None) -> None:
        self.rendered, self.tokens = rendered, tokens
        self.slots = threading.BoundedSemaphore(MAX_HANDLERS)
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        self.slots.acquire()  # the accept loop waits: further scrapers queue in the backlog
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up mid-reply: no traceback per scraper


class MetricsServer:
    """``GET /metrics`` of ``registry`` on ``host:port`` (``port`` 0: any free one), on a
    thread of its own; ``renders`` counts the renders."""

    def __init__(
        self, registry: CollectorRegistry, host: str, port: int, token_file: str = "",
        cache_s: float = 1.0,
    ) -> None:  # fmt: skip
        tokens = Tokens(token_file) if token_file else None
        if tokens is not None:
            tokens.accepts(None)  # read now: the start logs a broken file at once
        self.rendered = Rendered(registry, cache_s)
        self.server = MetricsHTTPServer((host.strip("[]"), port), self.rendered, tokens)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="metrics-http", daemon=True
        )
        self.thread.start()

    @property
    def renders(self) -> int:
        return self.rendered.renders

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_server(
    registry: CollectorRegistry, host: str, port: int, token_file: str = "", cache_s: float = 1.0
) -> MetricsServer | None:
    """The endpoint on ``host:port``; None (and one error line) if it cannot bind, so that a
    busy metrics port never takes the scoring service down. 0 = off."""
    if port == 0:
        return None
    try:
        server = MetricsServer(registry, host, port, token_file, cache_s)
    except OSError as e:
        logger.error(
            "metrics endpoint %s:%d not started: %s (set metrics.port or "
            "RECSYS_GATEWAY_METRICS_PORT; 0 = off)", host, port, e.strerror or e,
        )  # fmt: skip
        return None
    exposed = host.strip("[]") not in LOOPBACK
    logger.log(
        logging.WARNING if exposed and not token_file else logging.INFO,
        "metrics on http://%s:%d/metrics (%s)%s", host, server.port,
        "bearer token" if token_file else "no token",
        ": anyone reaching this address reads them (metrics.token_file)" if exposed and not token_file else "",
    )  # fmt: skip
    return server
