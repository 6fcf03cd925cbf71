"""HTTP probes for a TorchServe container: ``GET /readyz`` and ``GET /livez`` for a kubelet.

Why not TorchServe's own ``/ping``: it answered 200 while the model's worker was still loading
(docker/healthcheck.py), and TorchServe 0.12 wants the inference key on it, which a kubelet's
``httpGet`` cannot send (the key is written at each start). Why not an ``exec`` probe running
``docker/healthcheck.py``: each one starts a Python interpreter (1.2-2.1 s of CPU measured at
load), every few seconds, in every replica. Here the container's entry
(docker/torchserve_entry.py) asks the management API once every ``interval_s`` in a thread and
the probes read what it last saw: a probe costs one local HTTP request.

- ``/readyz``: 200 when the last answer, at most ``stale_s`` old, had a READY worker.
- ``/livez``: 200 while TorchServe's process runs and its management API answered (anything,
  even no READY worker) within ``stale_s``: a frontend that stopped answering is restarted, a
  worker reloading is not. Before the first answer it is 503: gate it with a ``startupProbe``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

PORT_ENV = "RECSYS_TS_PROBE_PORT"
"""The probes' port (the container entry's; unset or 0 = no probe server)."""


class Probes:
    """What the probes answer, from ``describe()`` (the management API's model description,
    raising when unreachable) called by :meth:`run` every ``interval_s``."""

    def __init__(
        self,
        describe: Callable[[], list[dict[str, Any]]],
        alive: Callable[[], bool],
        stale_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.describe, self.alive, self.stale_s, self.clock = describe, alive, stale_s, clock
        self.answered_at: float | None = None
        self.ready_workers = 0

    def check(self) -> None:
        """One round: ask the management API, keep what it said (nothing when it failed)."""
        try:
            models = self.describe()
        except (OSError, ValueError, KeyError, RuntimeError) as e:  # no answer: 503 when stale
            logger.debug("probe: management API: %s", e)
            return
        self.ready_workers = sum(
            w.get("status") == "READY" for m in models for w in m.get("workers", [])
        )
        self.answered_at = self.clock()

    def _fresh(self) -> bool:
        return self.answered_at is not None and self.clock() - self.answered_at <= self.stale_s

    def live(self) -> bool:
        return self.alive() and self._fresh()

    def ready(self) -> bool:
        return self.live() and self.ready_workers > 0

    def run(self, stop: threading.Event, interval_s: float = 2.0) -> None:
        while not stop.is_set():
            self.check()
            stop.wait(interval_s)


def serve(probes: Probes, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Answer ``/readyz`` and ``/livez`` on ``host:port`` in a daemon thread (``shutdown()``
    to stop); anything else is 404."""
    checks = {"/readyz": probes.ready, "/livez": probes.live}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            check = checks.get(self.path)
            ok = check() if check else False
            self.send_response(200 if ok else 404 if check is None else 503)
            body = b"ok\n" if ok else b"not found\n" if check is None else b"not yet\n"
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a probe every few seconds is not news

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probes", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    """``python -m serving.torchserve.probe URL``: exit 0 when ``GET URL`` answers 200 (a probe
    as one command without spaces inside its arguments, which podman 4.3 splits on)."""
    import sys
    import urllib.request

    args = sys.argv[1:] if argv is None else argv
    try:
        with urllib.request.urlopen(args[0], timeout=5) as r:
            return 0 if r.status == 200 else 1
    except (OSError, IndexError) as e:
        print(f"probe: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
