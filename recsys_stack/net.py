"""Network helpers shared by the launcher, the gateway's tests, the benchmark and the load test."""

from __future__ import annotations

import os
import random
import socket
import threading
from collections.abc import Collection

# Ports this process has handed out. The kernel may give a port back as soon as its probe
# socket closes, so two calls made before the first caller binds (two TorchServe replicas
# configured one after the other) could otherwise get the same port: seen as "Address already
# in use" in a replica that then exited.
_given: set[int] = set()
_lock = threading.Lock()

PORT_RANGE_ENV = "RECSYS_PORT_RANGE"
"""``LO-HI``: take free ports from this range only (inclusive), not from the kernel's ephemeral
range. Several stacks started side by side (the test suite's parallel workers) each get their
own range, so one cannot take a port another has chosen but not bound yet, and no outgoing
connection (those take ephemeral ports) can either."""


def port_range() -> range | None:
    """The range :data:`PORT_RANGE_ENV` names; None when unset. ValueError saying what is
    wrong when it is set but is no ``LO-HI`` of ports."""
    text = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not text:
        return None
    lo, sep, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi)
    except ValueError:
        first = last = -1
    if not sep or not 1024 <= first <= last <= 65535:
        raise ValueError(
            f"{PORT_RANGE_ENV}={text!r}: give LO-HI, two ports 1024..65535 (e.g. 20000-21999)"
        )
    return range(first, last + 1)


def _bindable(s: socket.socket, host: str, port: int) -> bool:
    try:
        s.bind((host, port))
    except OSError:
        return False
    return True


def named_ports(*configs: object) -> set[int]:
    """The ports ``configs`` (dataclass instances) name: each ``*port`` field set above 0 (the
    ``avoid`` of :func:`free_ports` while those are not bound yet)."""
    return {v for c in configs for k, v in vars(c).items()
            if k.endswith("port") and isinstance(v, int) and v > 0}  # fmt: skip


def free_ports(n: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> list[int]:
    """``n`` distinct free TCP ports on ``host`` (held together while chosen, so distinct), none
    handed out before by this process nor in ``avoid`` (ports a config names but nothing has
    bound yet); from :data:`PORT_RANGE_ENV`'s range when it is set."""
    within = port_range()
    order = iter(random.sample(within, len(within))) if within is not None else None
    socks: list[socket.socket] = []
    try:
        with _lock:
            ports: list[int] = []
            while len(ports) < n:
                if len(socks) > n + 10_000:
                    raise OSError(f"no {n} free ports on {host} not handed out before")
                s = socket.socket()
                socks.append(s)
                if order is None:
                    s.bind((host, 0))
                else:
                    port = next(order, None)
                    if port is None:
                        assert within is not None
                        raise OSError(
                            f"no {n} free ports on {host} in {PORT_RANGE_ENV}="
                            f"{within[0]}-{within[-1]}: widen it or stop what holds them"
                        )
                    if port in _given or port in avoid or not _bindable(s, host, port):
                        continue
                port = s.getsockname()[1]
                if port not in _given and port not in avoid:
                    ports.append(port)
            _given.update(ports)
            return ports
    finally:
        for s in socks:
            s.close()
