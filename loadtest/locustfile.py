"""Locust gRPC user for the gateway's ``recsys.v1.Ranker/Score``.

``locust -f loadtest/locustfile.py --host 127.0.0.1:50051`` (or ``python -m loadtest.run``,
which sets everything below). Each call is reported through ``events.request`` by a client
interceptor (request_type "grpc", name "recsys.v1.Ranker/Score"; a failed call under
"recsys.v1.Ranker/Score (failed)", so that Locust's figures of each name hold one kind of call,
the success percentiles no failure), so the User stays thin. A reply is a success only if it
holds one probability in [0, 1] per example and names the model and version (``check_reply``);
anything else is a failure with its reason. As it quits, each process writes its end-of-run
figures (``loadtest/tally.py``): Locust's CSVs are once-a-second snapshots that miss the end. The channel is
every tool's (``serving/tools/channel.py``): it retries a call the gateway never ran
(UNAVAILABLE, CANCELLED: what a gateway takeover costs), so Locust sees one call, its time
including the retries. Calls wait for a connection within their deadline (gRPC's
``wait_for_ready``, as a client of a service behind rolling updates should): while no gateway
address is connected, for a moment during a rolling update (compose replaces a gateway: a
new address, up to ~4 s with neither connected on a loaded 2-core machine), a call waits
instead of failing at once; a gateway down longer than the deadline still fails its calls.

Settings (environment, read by each load process):
  RECSYS_GATEWAY          host:port when ``--host`` is not given (default 127.0.0.1:50051)
  LOADTEST_DATA           Criteo TSV to draw payloads from (default: data/synthetic/*.tsv)
  LOADTEST_EXAMPLES       examples per request (default 100)
  LOADTEST_SAMPLE_ROWS    the working set: the whole file up to this many rows, else this
                          many sampled across all of it (default 20000; loadtest/payload.py)
  LOADTEST_SEED           the sample's and the pool's seed (default 0): every process the same
  LOADTEST_REPORT_PREFIX  where the end-of-run files go (default: Locust's --csv prefix)
  LOADTEST_TIMEOUT_S      per-call deadline (default 5)
  RECSYS_GATEWAY_TOKEN_FILE  the gateway's token file (default: runs/serve/gateway_token, or
                          $RECSYS_SERVE_DIR/gateway_token, when it exists: what `make serve`
                          writes); its first token goes as ``authorization: Bearer <token>``
  RECSYS_AUTH_TOKEN       a token to send instead of the file's
  RECSYS_CLIENT_TLS_CA, RECSYS_CLIENT_TLS_CERT, RECSYS_CLIENT_TLS_KEY,
  RECSYS_CLIENT_TLS_SERVER_NAME, RECSYS_CLIENT_TLS
                          TLS and mutual TLS, as for every tool of ours
                          (serving/tools/channel.py); all unset = plaintext
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# isort: off
from locust import User, constant, events, task  # first: it monkey-patches with gevent
from locust.runners import LocalRunner
import gevent
import gevent.lock
import grpc
import grpc.experimental.gevent as grpc_gevent

# isort: on

# gRPC's own I/O must yield to gevent, or one blocking call stalls every user of the process.
# This has to run before any channel exists.
grpc_gevent.init_gevent()

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `locust -f` puts only loadtest/ on the path
    sys.path.insert(0, str(ROOT))

from loadtest import tally  # noqa: E402
from loadtest.checks import check_reply  # noqa: E402
from loadtest.payload import request_pool, working_set  # noqa: E402
from serving.gateway.auth import call_metadata, client_token  # noqa: E402
from serving.stubs import ranker_pb2_grpc  # noqa: E402
from serving.tools.channel import from_env, open_channel  # noqa: E402

NAME = "recsys.v1.Ranker/Score"


class GrpcError(Exception):
    """A failed call, as ``CODE: details`` (Locust groups failures by this text)."""


class LocustInterceptor(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Times each unary call and fires Locust's ``events.request`` for it."""

    def __init__(self, fire: Callable[..., Any]) -> None:
        self.fire = fire
        self.tally = TALLY

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], call_details: Any, request: Any
    ) -> Any:
        started, t0 = time.time(), time.perf_counter()
        call = continuation(call_details, request)
        exception: Exception | None = None
        length = 0
        try:
            reply = call.result()
            length = reply.ByteSize()
            exception = check_reply(request, reply)
        except grpc.RpcError as e:
            exception = GrpcError(f"{e.code().name}: {e.details()}")
        method = call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        self.tally.record(started, failed=exception is not None)
        self.fire(
            request_type="grpc",
            name=method.lstrip("/") + (tally.FAILED if exception is not None else ""),
            response_time=(time.perf_counter() - t0) * 1000.0,
            response_length=length,
            exception=exception,
            context={},
        )
        return call


_POOL: list[Any] = []
_POOL_LOCK = gevent.lock.Semaphore()
TALLY = tally.Tally()  # this process's own count of its calls
_ENV: list[Any] = []  # Locust's Environment, from the init event


def _pool() -> list[Any]:
    """Requests shared by the users of this process, built once (not in the master). Building
    1,024 requests takes seconds of CPU on a busy machine (3.5 s at load 8): done before the run's
    clock starts (:func:`_build_before_the_clock`), or else in a native thread, so that the
    gevent hub keeps a worker's heartbeats going (on the hub, the master dropped both compose
    workers as missing and ended the run after 3 calls)."""
    with _POOL_LOCK:
        if not _POOL:
            data = os.environ.get("LOADTEST_DATA") or next(
                iter(sorted(map(str, (ROOT / "data/synthetic").glob("*.tsv")))), ""
            )
            if not data:
                raise RuntimeError("no payload data: set LOADTEST_DATA to a Criteo TSV")
            examples = int(os.environ.get("LOADTEST_EXAMPLES", "100"))
            rows = int(os.environ.get("LOADTEST_SAMPLE_ROWS", "20000"))
            seed = int(os.environ.get("LOADTEST_SEED", "0"))
            _POOL.extend(
                gevent.get_hub().threadpool.apply(_build, (Path(data), examples, rows, seed))
            )
    return _POOL


def _build(data: Path, examples: int, rows: int, seed: int) -> list[Any]:
    """The working set and its requests; what they are goes into this process's tally."""
    ws = working_set(data, rows, seed)
    pool = request_pool(ws, examples, seed=seed)
    TALLY.working_set = {**ws.info, "source": str(data), "requests": len(pool)}
    return pool


@events.init.add_listener
def _build_before_the_clock(environment: Any, **_kw: Any) -> None:
    """A local run builds its pool before its users start (``--run-time`` counts from then);
    a worker already has its own (built at import, before it told the master it is ready)."""
    _ENV.append(environment)
    if isinstance(environment.runner, LocalRunner):
        _pool()


@events.init.add_listener
def _interrupt_in_the_main_greenlet(**_kw: Any) -> None:
    """SIGINT (how ``loadtest.locust_runner`` ends a load early) as Locust's own Ctrl-C, but
    raised in its main greenlet, from gevent's hub: Python raises KeyboardInterrupt in whatever
    runs when the signal lands, under load a user's gRPC call, which Locust logs as that user's
    failure, and the process then hung after its report (chaos on 2 cores). Installed by a
    handler of its own, it also holds where a shell started the load in the background with
    SIGINT ignored."""
    main = gevent.getcurrent()  # init fires in Locust's main(), which then joins its run
    gevent.signal_handler(signal.SIGINT, lambda: main.throw(KeyboardInterrupt))


@events.quit.add_listener
def _write_tally(**_kw: Any) -> None:
    """After Locust's end (users stopped, a master's last worker reports in): the final stats
    and this process's own count (``loadtest/tally.py``)."""
    where = tally.prefix(_ENV[0]) if _ENV else None
    if where:
        tally.write_final(_ENV[0], where)
        tally.write_load(TALLY, where)


if "--worker" in sys.argv:  # `locust --worker`: ready = able to send, not seconds later
    _pool()


class RankerUser(User):
    """One closed-loop client: a channel of its own, calls back to back."""

    wait_time = constant(0)

    def on_start(self) -> None:
        target = self.host or os.environ.get("RECSYS_GATEWAY", "127.0.0.1:50051")
        channel = from_env()
        self.channel = grpc.intercept_channel(
            open_channel(target, channel), LocustInterceptor(self.environment.events.request.fire)
        )
        self.stub = ranker_pb2_grpc.RankerStub(self.channel)
        self.timeout = float(os.environ.get("LOADTEST_TIMEOUT_S", "5"))
        token = os.environ.get("RECSYS_AUTH_TOKEN") or client_token(channel.token_file)
        self.metadata = call_metadata(token)
        self.pool = _pool()

    def on_stop(self) -> None:
        self.channel.close()

    @task
    def score(self) -> None:
        with contextlib.suppress(grpc.RpcError):  # reported by the interceptor
            self.stub.Score(random.choice(self.pool), timeout=self.timeout,
                            metadata=self.metadata, wait_for_ready=True)  # fmt: skip


__all__ = ["RankerUser", "events"]
