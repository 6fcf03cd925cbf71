"""The gateway's Prometheus metrics: ``GET http://127.0.0.1:<metrics.port>/metrics``.

One :class:`GatewayMetrics` per gateway process (:func:`configure` makes it, ``serve()``
calls it); the hot path calls the module functions below, which do nothing before
:func:`configure` (unit tests of the coalescer or the pool need no registry). Label children
are made once, so a call costs a dict lookup and an observe.

The endpoint (:mod:`serving.gateway.metrics_http`) is not an amplifier nor an open door: bound
to loopback unless ``metrics.host`` exposes it on purpose (the series name backends, the plan
file), an optional bearer token (``metrics.token_file``: 401 without it), and one render per
``metrics.cache_s`` (1 s) however many scrape. The token file of the gateway's own auth shows as
its file name only, never its absolute path.

Exported (prefix ``recsys_gateway_``):

- ``requests_total{method,code}``, ``request_seconds{method}``: every unary call, counted by
  :class:`MetricsInterceptor` with the status code it ended with (UNAUTHENTICATED included).
- ``in_flight_requests``: unary calls being served now. An aborted call's status reaches its
  client before the call is counted (grpc.aio sends it from ``abort``); once this reads 0,
  every answered call is in the counters.
- ``examples_per_request``: examples in each valid ``Score`` request.
- ``backend_call_examples``, ``backend_call_requests``: size of each TorchServe call after
  coalescing (examples, and requests merged into it); ``backend_calls_in_flight``, and
  ``backend_call_slots``: how many may be (``coalesce.calls_per_worker`` x the workers the
  replicas in rotation report).
- ``rejections_total{reason}``: calls refused before scoring (invalid, unauthenticated, and the
  admission control's reasons).
- ``backend_healthy{backend}`` (1/0, read at scrape time), ``backend_failovers_total{backend}``:
  calls given up on a backend after an outage that cannot have reached a worker, to be retried
  on another one if any is left (the backend leaves rotation; a timeout is never retried).
- ``model_info{model_name,model_version}``: each served version (always 1);
  ``version_traffic_ratio{model_version}``: its share of the requests that name no version;
  ``plan_generation{plan}``: the serving plan applied, by plan file (serving/plan.py).
- ``version_requests_total{model_version,code}``: requests per version by the status code its
  scoring ended with (OK, or the backend failure's: INTERNAL, UNAVAILABLE, DEADLINE_EXCEEDED;
  refusals before a version is chosen are not counted here); ``scores{model_version}``
  (histogram of each OK request's mean click probability): traffic, errors and predicted CTR
  per version, to compare a canary with the default while a rollout shifts traffic (the
  rollout's error gate reads them, serving/tools/canary.py).
- ``auth_token_file_ok{token_file}``: 1 while the tokens of ``auth.token_file`` are in force, 0
  while it is emptied, deleted, unreadable or unparsable and every call is refused (absent
  without a token file); ``auth_token_file_errors_total{token_file}``: reads of it that failed
  (serving/gateway/auth.py). The label is the file's name, not its path (where the secret
  lives is not the scrapers' business).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from serving.gateway import metrics_http, tally
from serving.gateway.metrics_http import MetricsServer
from serving.gateway.rpc import WrappingInterceptor
from serving.gateway.tally import Tally

PREFIX = "recsys_gateway"
REJECTION_REASONS = ("invalid", "unauthenticated", "overload", "deadline")


def size_buckets(largest: int) -> list[float]:
    """1, 2, 4, ... up to the first power of two >= ``largest`` (at least [1])."""
    out, b = [1.0], 1
    while b < largest:
        b *= 2
        out.append(float(b))
    return out


class GatewayMetrics:
    """The metric objects of one gateway, in their own registry."""

    def __init__(self, max_request_examples: int, max_call_examples: int) -> None:
        r = self.registry = CollectorRegistry()
        hot = Tally(r)  # what every call updates: plain numbers read at scrape time
        self.requests = tally.counter(
            hot, f"{PREFIX}_requests", "gRPC calls by method and status code", ["method", "code"]
        )
        self.latency = tally.histogram(
            hot, f"{PREFIX}_request_seconds", "gRPC call latency in the gateway", ["method"]
        )
        self.in_flight = Gauge(f"{PREFIX}_in_flight_requests", "calls being served", registry=r)
        self.serving_now = 0  # what in_flight reads at scrape time (a locked gauge costs more)
        self.in_flight.set_function(lambda: float(self.serving_now))
        self.examples = tally.histogram(
            hot, f"{PREFIX}_examples_per_request", "examples in each valid Score request",
            buckets=size_buckets(max_request_examples),
        )  # fmt: skip
        call_buckets = size_buckets(max(max_call_examples, max_request_examples))
        self.call_examples = tally.histogram(
            hot, f"{PREFIX}_backend_call_examples", "examples in each TorchServe call (coalesced)",
            buckets=call_buckets,
        )  # fmt: skip
        self.call_requests = tally.histogram(
            hot, f"{PREFIX}_backend_call_requests", "requests merged into each TorchServe call",
            buckets=call_buckets,
        )  # fmt: skip
        self.backend_in_flight = Gauge(
            f"{PREFIX}_backend_calls_in_flight", "TorchServe calls in flight", registry=r
        )
        self.call_slots = Gauge(
            f"{PREFIX}_backend_call_slots", "TorchServe calls in flight at most per model "
            "version (coalesce.calls_per_worker x the workers of the replicas in rotation)",
            registry=r,
        )  # fmt: skip
        self.rejections_total = Counter(
            f"{PREFIX}_rejections", "calls refused before scoring, by reason", ["reason"],
            registry=r,
        )  # fmt: skip
        self.rejections = {k: self.rejections_total.labels(k) for k in REJECTION_REASONS}
        self.healthy = Gauge(
            f"{PREFIX}_backend_healthy", "1 while a TorchServe backend is in rotation",
            ["backend"], registry=r,
        )  # fmt: skip
        self._failovers = Counter(
            f"{PREFIX}_backend_failovers", "calls moved off a backend after an outage that "
            "cannot have reached a worker", ["backend"], registry=r,
        )  # fmt: skip
        self.failovers: dict[str, Any] = {}
        self._hedges = Counter(
            f"{PREFIX}_backend_hedges", "second copies of calls their first backend was slow to "
            "answer, by the backend the copy went to", ["backend"], registry=r,
        )  # fmt: skip
        self.model = Gauge(
            f"{PREFIX}_model_info", "the served model versions", ["model_name", "model_version"],
            registry=r,
        )  # fmt: skip
        self.traffic = Gauge(
            f"{PREFIX}_version_traffic_ratio", "share of the requests naming no version",
            ["model_version"], registry=r,
        )  # fmt: skip
        self.generation = Gauge(
            f"{PREFIX}_plan_generation", "generation of the serving plan applied, by plan file "
            "(absolute path; empty: no plan file)", ["plan"], registry=r,
        )  # fmt: skip
        self.version_requests = tally.counter(
            hot, f"{PREFIX}_version_requests", "requests per model version, by the status code "
            "their scoring ended with", ["model_version", "code"],
        )  # fmt: skip
        self.scores = tally.histogram(
            hot, f"{PREFIX}_scores", "mean click probability of each request, per model version",
            ["model_version"], buckets=[i / 20 for i in range(1, 21)],
        )  # fmt: skip
        self.serving = Gauge(
            f"{PREFIX}_backend_serving_info", "what a backend's workers serve for a version "
            "(1 per backend and version in rotation)",
            ["backend", "model_version", "device", "variant", "dtype"], registry=r,
        )  # fmt: skip
        self.token_file_ok = Gauge(
            f"{PREFIX}_auth_token_file_ok", "1 while the token file's tokens are in force, 0 "
            "while it cannot be used and every call is refused (label: the file's name)",
            ["token_file"], registry=r,
        )  # fmt: skip
        self.token_file_errors = Counter(
            f"{PREFIX}_auth_token_file_errors", "reads of the token file that failed (empty, "
            "missing, unreadable, unparsable): no token accepted after each", ["token_file"],
            registry=r,
        )  # fmt: skip
        self._serving: dict[tuple[str, str], tuple[str, ...]] = {}
        self._by_version: dict[str, tuple[Any, Any]] = {}
        self._failed: dict[tuple[str, Any], Any] = {}

    def show_plan(self, model: str, versions: Iterable[str], shares: dict[str, float],
                  generation: int, plan_file: str = "") -> None:  # fmt: skip
        """Model info, traffic shares and generation of the plan now applied."""
        self.model.clear()
        self.generation.clear()
        self.traffic.clear()
        for v in versions:
            self.model.labels(model, v).set(1)
            self.traffic.labels(v).set(shares.get(v, 0.0))
        self.generation.labels(plan_file).set(generation)

    def track_in_flight(self, calls: Callable[[], int]) -> None:
        """``backend_calls_in_flight`` read from ``calls()`` at scrape time."""
        self.backend_in_flight.set_function(lambda: float(calls()))


def _healthy(backend: Any) -> float:
    return float(backend.healthy)


_current: GatewayMetrics | None = None


def configure(max_request_examples: int, max_call_examples: int) -> GatewayMetrics:
    """Make this process's metrics (a new registry; the hot-path functions use it)."""
    global _current
    _current = GatewayMetrics(max_request_examples, max_call_examples)
    return _current


# --- hot-path calls (no-ops before configure) ------------------------------------------------


def examples(n: int) -> None:
    """A valid Score request of ``n`` examples."""
    if _current is not None:
        _current.examples.observe(n)


def backend_call(requests: int, n_examples: int) -> None:
    """A TorchServe call carrying ``requests`` merged requests, ``n_examples`` examples."""
    if _current is not None:
        _current.call_requests.observe(requests)
        _current.call_examples.observe(n_examples)


def call_slots(n: int) -> None:
    """The coalescers' backend calls in flight at most now (per model version)."""
    if _current is not None:
        _current.call_slots.set(n)


def show_plan(
    model: str, versions: Iterable[str], shares: dict[str, float], generation: int,
    plan_file: str = "",
) -> None:  # fmt: skip
    """The serving plan now applied (model info per version, traffic shares, generation of
    ``plan_file``: a rollout reading the metrics knows they are its own gateway's)."""
    if _current is not None:
        _current.show_plan(model, versions, shares, generation, plan_file)


def scored(version: str, scores: Any) -> None:
    """A request answered by ``version`` with ``scores`` (f32[B]): its count and scores."""
    if _current is not None:
        children = _current._by_version.get(version)
        if children is None:
            children = _current._by_version[version] = (
                _current.version_requests.labels(version, "OK"),
                _current.scores.labels(version),
            )
        children[0].inc()
        if len(scores):  # one observation per request, not per example: the hot path
            children[1].observe(float(scores.sum()) / len(scores))


def failed(version: str, code: grpc.StatusCode) -> None:
    """A request for ``version`` whose scoring failed with ``code`` (its backend's failure)."""
    if _current is not None:
        child = _current._failed.get((version, code))
        if child is None:
            child = _current.version_requests.labels(version, code.name)
            _current._failed[(version, code)] = child
        child.inc()


def serving(backend: str, version: str, served: dict[str, str] | None) -> None:
    """What ``backend`` serves for ``version`` (device, variant, dtype); None: nothing now."""
    if _current is not None:
        old = _current._serving.pop((backend, version), None)
        if old is not None:
            _current.serving.remove(*old)
        if served is not None:
            labels = (backend, version, served["device"], served["variant"], served["dtype"])
            _current.serving.labels(*labels).set(1)
            _current._serving[(backend, version)] = labels


def rejected(reason: str) -> None:
    """A call refused before scoring; ``reason`` one of :data:`REJECTION_REASONS` (another
    name gets its own series rather than an error on the hot path)."""
    if _current is not None:
        child = _current.rejections.get(reason)
        if child is None:
            child = _current.rejections[reason] = _current.rejections_total.labels(reason)
        child.inc()


def token_file(path: str, ok: bool) -> None:
    """The token file ``path`` was read: ``ok`` = its tokens are in force; else none is and
    every call is refused (serving/gateway/auth.py)."""
    if _current is not None:
        name = os.path.basename(path)  # not where the secret lives
        _current.token_file_ok.labels(name).set(1.0 if ok else 0.0)
        if not ok:
            _current.token_file_errors.labels(name).inc()


def hedged(backend: str) -> None:
    """A slow call's second copy goes to ``backend`` (serving/gateway/hedge.py)."""
    if _current is not None:
        _current._hedges.labels(backend).inc()


def track_backend(b: Any) -> None:
    """A replica joined (at start, or found by discovery): ``backend_healthy`` reads its
    ``healthy`` at scrape time."""
    if (m := _current) is not None:
        m.healthy.labels(b.target).set_function(functools.partial(_healthy, b))
        m.failovers[b.target] = m._failovers.labels(b.target)


def untrack_backend(target: str) -> None:
    """A replica left (discovery): its series go with it."""
    if (m := _current) is not None and m.failovers.pop(target, None) is not None:
        m.healthy.remove(target)
        m._failovers.remove(target)
        for key in [k for k in m._serving if k[0] == target]:
            m.serving.remove(*m._serving.pop(key))


def failover(backend: str) -> None:
    """A call leaves ``backend`` for another after an outage (the backend leaves rotation)."""
    if _current is not None and backend in _current.failovers:
        _current.failovers[backend].inc()


# --- the gRPC side ---------------------------------------------------------------------------


class MetricsInterceptor(WrappingInterceptor):
    """Counts unary and stream-unary calls by method and final code and times them.

    Wrapped handlers are cached per handler object: per call, one dict lookup, a count of calls
    in flight (read at scrape time), an observe and a counter inc on label children made once
    (a code's on its first call, so /metrics lists the codes that happened, not every code of
    every method)."""

    def __init__(self, m: GatewayMetrics) -> None:
        super().__init__()
        self.m = m

    def wraps(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        return (handler.unary_unary or handler.stream_unary) is not None

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The handler, timed and counted (unary-unary, or stream-unary: the scoring calls
        behind the admission gate, serving/gateway/admission.py)."""
        inner = handler.unary_unary or handler.stream_unary
        m = self.m
        latency = m.latency.labels(method)
        requests = m.requests
        by_code = {grpc.StatusCode.OK: requests.labels(method, "OK")}  # others on first use

        async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0 = time.perf_counter()
            m.serving_now += 1
            code = grpc.StatusCode.UNKNOWN
            try:
                response = await inner(request, context)
                code = context.code() or grpc.StatusCode.OK
                return response
            except asyncio.CancelledError:
                code = grpc.StatusCode.CANCELLED
                raise
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                latency.observe(time.perf_counter() - t0)
                counter = by_code.get(code)
                if counter is None:
                    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
                    counter = by_code[code] = requests.labels(method, name)
                counter.inc()
                m.serving_now -= 1  # last: in_flight 0 means every answered call is counted

        make = (
            grpc.unary_unary_rpc_method_handler
            if handler.unary_unary
            else grpc.stream_unary_rpc_method_handler
        )
        return make(behavior, handler.request_deserializer, handler.response_serializer)


def start_server(
    m: GatewayMetrics, host: str, port: int, token_file: str = "", cache_s: float = 1.0
) -> MetricsServer | None:
    """``GET /metrics`` of ``m`` on ``host:port`` (:mod:`serving.gateway.metrics_http`: a
    token, a 1 s cache); None (one error line) when it cannot bind or ``port`` is 0."""
    return metrics_http.start_server(m.registry, host, port, token_file, cache_s)


__all__ = [
    "GatewayMetrics", "MetricsInterceptor", "MetricsServer", "backend_call", "call_slots", "configure",
    "examples", "failed", "failover", "rejected", "scored", "show_plan", "start_server",
    "token_file",
]  # fmt: skip
