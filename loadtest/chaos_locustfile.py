"""Locust user for the chaos run: the load test's user, plus one record per call.

``python -m loadtest.chaos`` runs Locust with this file. Each call is still reported to Locust
by the load test's interceptor (``loadtest/locustfile.py``: same payloads, same reply check);
in addition every call appends one line to ``$CHAOS_REQUEST_LOG/requests-<pid>.csv``::

    start (unix s), latency (ms), code (OK | a gRPC code name | BAD_REPLY), backend

``backend`` is the gateway's ``x-recsys-backend`` trailing metadata: the TorchServe replica that
answered, which shows when a restarted replica takes traffic again. Lines are written whole
and flushed at once, so the chaos runner reads them while the load runs.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path
from typing import IO, Any

# isort: off
import loadtest.locustfile as base  # first: Locust's gevent patching, then gRPC's gevent mode

# isort: on
import grpc

from loadtest.chaos_report import LOG_ENV
from loadtest.checks import check_reply

BACKEND_HEADER = "x-recsys-backend"
_OUT: list[IO[str]] = []


def _log() -> IO[str]:
    """This process's record file, opened on first use (line-buffered: readable while running)."""
    if not _OUT:
        folder = Path(os.environ.get(LOG_ENV) or ".")
        folder.mkdir(parents=True, exist_ok=True)
        _OUT.append((folder / f"requests-{os.getpid()}.csv").open("a", buffering=1))
    return _OUT[0]


def _backend(call: Any) -> str:
    with contextlib.suppress(Exception):  # no metadata when the call failed
        for key, value in call.trailing_metadata() or ():
            if key == BACKEND_HEADER:
                return str(value)
    return ""


class ChaosUser(base.RankerUser):
    """A closed-loop client like the load test's, recording each call's code and backend."""

    def scored(self) -> None:
        request = random.choice(self.pool)
        t0 = time.time()
        try:
            reply, call = self.stub.Score.with_call(
                request, timeout=self.timeout, metadata=self.metadata
            )
            code = "BAD_REPLY" if check_reply(request, reply) else "OK"
        except grpc.RpcError as e:  # also reported to Locust by the interceptor
            call, code = e, e.code().name
        ms = (time.time() - t0) * 1000.0
        _log().write(f"{t0:.6f},{ms:.3f},{code},{_backend(call)}\n")


# Replace (not add to) the inherited task: a subclass's tasks are appended to its base's.
ChaosUser.tasks = [ChaosUser.scored]


@base.events.init.add_listener
def _build_pool(**_: Any) -> None:
    """Payloads before the run starts: Locust's ``-t`` clock would otherwise count the seconds
    the pool takes to build, and the chaos run's faults are timed from the first call."""
    base._pool()


__all__ = ["ChaosUser", "base"]
