"""Network helpers shared by the launcher, the gateway's tests, the benchmark and the load test."""

from __future__ import annotations

import socket
import threading

# Ports this process has handed out. The kernel may give a port back as soon as its probe
# socket closes, so two calls made before the first caller binds (two TorchServe replicas
# configured one after the other) could otherwise get the same port: seen as "Address already
# in use" in a replica that then exited.
_given: set[int] = set()
_lock = threading.Lock()


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free TCP ports on ``host`` (held together while chosen, so distinct), none
    handed out before by this process."""
    socks: list[socket.socket] = []
    try:
        with _lock:
            ports: list[int] = []
            while len(ports) < n:
                if len(socks) > n + 10_000:
                    raise OSError(f"no {n} free ports on {host} not handed out before")
                s = socket.socket()
                socks.append(s)
                s.bind((host, 0))
                port = s.getsockname()[1]
                if port not in _given:
                    ports.append(port)
            _given.update(ports)
            return ports
    finally:
        for s in socks:
            s.close()
