"""Connections are a resource: the open-files limit, caps, idle and silent connections closed.

Measured before this module: with the soft open-files limit at 1,024 and 1,100 idle
connections, accept() failed with EMFILE, re-reading the token file failed with EMFILE (every
valid call refused), readiness went 503 and asyncio logged a traceback per failed accept (3,319
of them); idle TLS connections to the gRPC port were never closed, and a silent one lived for
grpc's 120 s handshake timeout. So the gateway:

- raises its soft ``RLIMIT_NOFILE`` to the hard limit at start (:func:`raise_open_files_limit`),
  and lowers its connection caps to fit under it when they do not (:func:`fit`);
- gives its gRPC server the ``connections`` options (:func:`grpc_options`): idle connections
  closed, every connection aged out (clients re-resolve; new replicas of the gateway get their
  share), a total cap, a handshake timeout, streams per connection. grpc 1.81 honours
  ``grpc.max_allowed_incoming_connections``: a connection over it is closed as it is accepted,
  silent ones still in their handshake counted (tests/serving/test_connections.py). There is no
  per-peer cap on gRPC: grpc Python offers no hook at accept, and an interceptor sees calls,
  never connections (``iptables -m connlimit`` or a proxy in front can);
- counts KServe HTTP connections per peer address and in total from accept
  (:class:`GatedRunner`): one over a cap is closed at once, before any TLS work, which is done
  here (``loop.start_tls``) so that a connection is counted during its handshake and that
  handshake has ``connections.handshake_timeout_s``, as on gRPC;
- logs a failed accept (EMFILE, ENFILE, ENOBUFS, ENOMEM) and refused connections as one line
  per 10 s with a count of those held back, not one traceback each (:func:`quiet_accept_errors`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import resource
import ssl
from collections import Counter
from dataclasses import replace
from typing import Any, cast

from aiohttp import web

from recsys_stack.logs import OncePer
from serving.gateway.config import ConnectionsConfig
from serving.gateway.watched import OUT_OF_RESOURCES

logger = logging.getLogger("serving.gateway.connections")
RESERVED_FDS = 256  # descriptors beside connections: logs, token and plan files, backends, grpc
QUIET_S = 10.0  # one line per kind of fault per this many seconds
INT_MAX = 2**31 - 1  # grpc's channel arguments are C ints


def raise_open_files_limit() -> int:
    """Soft ``RLIMIT_NOFILE`` up to the hard limit (one line with both); the soft limit now.

    An unprivileged process may raise its soft limit up to the hard one: a gateway started
    with the common 1,024 otherwise runs out of descriptors at about a thousand connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft >= target:
        logger.info("open files limit %d (hard limit %d)", soft, hard)
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        logger.warning("open files limit %d not raised to the hard limit %d: %s", soft, hard, e)
        return soft
    logger.info("open files limit raised from %d to %d (the hard limit)", soft, target)
    return target


def fit(cfg: ConnectionsConfig, open_files: int, http: bool = True) -> ConnectionsConfig:
    """``cfg`` with its connection caps lowered in proportion, when they and
    :data:`RESERVED_FDS` exceed ``open_files`` (one warning); ``cfg`` when they fit, or when a
    cap is off (0: nothing to fit). ``http``: whether the HTTP port is on."""
    caps = [cfg.grpc_max_connections] + ([cfg.http_max_connections] if http else [])
    room = max(open_files - RESERVED_FDS, len(caps))
    if 0 in caps or sum(caps) <= room:
        return cfg
    k = room / sum(caps)
    grpc_max = max(1, int(cfg.grpc_max_connections * k))
    http_max = max(1, int(cfg.http_max_connections * k)) if http else cfg.http_max_connections
    logger.warning(
        "connections: grpc_max_connections %d%s + %d reserved descriptors exceed the open files "
        "limit %d: lowered to %d%s", cfg.grpc_max_connections,
        f" + http_max_connections {cfg.http_max_connections}" if http else "", RESERVED_FDS,
        open_files, grpc_max, f" + {http_max}" if http else "",
    )  # fmt: skip
    per_peer = min(cfg.http_max_per_peer, http_max) if cfg.http_max_per_peer else 0
    return replace(
        cfg, grpc_max_connections=grpc_max, http_max_connections=http_max,
        http_max_per_peer=per_peer,
    )  # fmt: skip


def grpc_options(cfg: ConnectionsConfig) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments for ``cfg`` (a key at 0 is left at grpc's default)."""
    ms = {
        "grpc.max_connection_idle_ms": cfg.grpc_idle_s,
        "grpc.max_connection_age_ms": cfg.grpc_max_age_s,
        "grpc.max_connection_age_grace_ms": cfg.grpc_age_grace_s,
        "grpc.server_handshake_timeout_ms": cfg.handshake_timeout_s,
    }
    counts = {
        "grpc.max_allowed_incoming_connections": cfg.grpc_max_connections,
        "grpc.max_concurrent_streams": cfg.grpc_max_streams,
    }
    options = [(k, min(max(1, round(v * 1000)), INT_MAX)) for k, v in ms.items() if v > 0]
    return options + [(k, min(v, INT_MAX)) for k, v in counts.items() if v > 0]


def _held(n: int) -> str:
    return f"; {n} more since the last line" if n else ""


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, period_s: float = QUIET_S) -> None:
    """``loop``'s exception handler: a failed accept for want of resources is one line per
    ``period_s`` (asyncio retries the accept every second and logs a traceback each time);
    anything else goes to the handler set before, or the default one."""
    once, previous = OncePer(period_s), loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        e = context.get("exception")
        if isinstance(e, OSError) and e.errno in OUT_OF_RESOURCES:
            if (held := once.ready()) is not None:
                limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                logger.error(
                    "%s: %s (open files limit %d)%s", context.get("message", "accept() failed"),
                    e, limit, _held(held),
                )  # fmt: skip
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def peer_of(transport: asyncio.BaseTransport) -> str:
    """The remote IP address of ``transport`` (an IPv4-mapped IPv6 one as IPv4)."""
    name = transport.get_extra_info("peername")
    host = str(name[0] if isinstance(name, tuple) and name else name)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


class PeerGate:
    """Open connections per peer address and in total, against caps (0 = no cap)."""

    def __init__(self, total: int, per_peer: int) -> None:
        self.total, self.per_peer = total, per_peer
        self.open = 0
        self.by_peer: Counter[str] = Counter()
        self._log = OncePer()

    def admit(self, peer: str) -> bool:
        """Count one more connection from ``peer``; False (not counted, one rate-limited log
        line) when that is over a cap."""
        if self.per_peer and self.by_peer[peer] >= self.per_peer:
            why = f"{self.by_peer[peer]} open from it (connections.http_max_per_peer)"
        elif self.total and self.open >= self.total:
            why = f"{self.open} open (connections.http_max_connections)"
        else:
            self.open += 1
            self.by_peer[peer] += 1
            return True
        if (held := self._log.ready()) is not None:
            logger.warning(
                "KServe HTTP: refused a connection from %s: %s%s", peer, why, _held(held)
            )
        return False

    def release(self, peer: str) -> None:
        self.open -= 1
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]


class _Gated(asyncio.Protocol):
    """One HTTP connection in front of aiohttp's handler (``inner``): counted by the gate from
    accept to close, closed at once when over a cap, TLS done here after the count."""

    def __init__(
        self, inner: asyncio.Protocol, gate: PeerGate, tls: ssl.SSLContext | None,
        handshake_s: float | None,
    ) -> None:  # fmt: skip
        self.inner, self.gate, self.tls, self.handshake_s = inner, gate, tls, handshake_s
        self.peer: str | None = None  # counted as this peer's, until released
        self.connected = False  # inner has had connection_made
        self.early: list[bytes] = []  # what TLS delivered before inner was connected
        self.eof = False
        self.handshake: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = cast(asyncio.Transport, transport)
        peer = peer_of(t)
        if not self.gate.admit(peer):
            t.abort()
            return
        self.peer = peer
        if self.tls is None:
            self._connect(t)
            return
        t.pause_reading()  # nothing read until start_tls reads the ClientHello (not app data)
        self.handshake = asyncio.get_running_loop().create_task(self._handshake(t))

    async def _handshake(self, transport: asyncio.Transport) -> None:
        try:
            tls = await asyncio.get_running_loop().start_tls(
                transport, self, cast(ssl.SSLContext, self.tls),
                server_side=True, ssl_handshake_timeout=self.handshake_s,
            )  # fmt: skip
        except Exception:  # timed out, reset, not TLS, no client certificate: closed by start_tls
            tls = None
        except BaseException:
            self._release()
            raise
        if tls is None or tls.is_closing():
            self._release()
            return
        self._connect(tls)

    def _connect(self, transport: asyncio.BaseTransport) -> None:
        self.connected = True
        self.inner.connection_made(transport)
        for data in self.early:
            self.inner.data_received(data)
        self.early.clear()
        if self.eof and not self.inner.eof_received():
            transport.close()

    def _release(self) -> None:
        if self.peer is not None:
            self.gate.release(self.peer)
            self.peer = None

    def data_received(self, data: bytes) -> None:
        if self.connected:
            self.inner.data_received(data)
        elif self.peer is not None:
            self.early.append(data)

    def eof_received(self) -> bool | None:
        if self.connected:
            return self.inner.eof_received()
        self.eof = True
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        if self.connected:
            self.connected = False
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.connected:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.connected:
            self.inner.resume_writing()


class _GatedServer:
    """aiohttp's ``web.Server`` whose connections pass :class:`_Gated` first."""

    def __init__(
        self, server: web.Server, gate: PeerGate, tls: ssl.SSLContext | None,
        handshake_s: float | None,
    ) -> None:  # fmt: skip
        self._server, self._args = server, (gate, tls, handshake_s)

    def __call__(self) -> asyncio.Protocol:
        return _Gated(self._server(), *self._args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class GatedRunner(web.AppRunner):
    """An ``AppRunner`` whose connections are capped by ``gate`` and upgraded to TLS with
    ``tls`` (give the site no ``ssl_context``: TLS happens after the count)."""

    def __init__(
        self, app: web.Application, gate: PeerGate, tls: ssl.SSLContext | None,
        handshake_s: float, **kwargs: Any,
    ) -> None:  # fmt: skip
        super().__init__(app, **kwargs)
        self._gate, self._tls, self._handshake_s = gate, tls, handshake_s or None

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return cast(web.Server, _GatedServer(server, self._gate, self._tls, self._handshake_s))
