"""TorchServe backends behind one gateway: health-aware round robin with failover.

Each backend has its own channel, key file (TorchServe writes new keys at every start) and
health, kept by a probe loop that sends a one-example request every interval and checks the
answer (one probability in [0, 1]: a handler that refuses every request is not healthy). Calls
go to the healthy backend with the fewest calls in flight, round robin between equals (to any
backend while none is known healthy). A call that fails as an outage (unreachable, no worker,
a worker that died, a stale key, no answer within the backend deadline) marks its backend unhealthy. It is retried on another backend,
while the client's deadline allows, only when it failed fast: never after a timeout, which
would double the load on replicas exactly when they are too slow. Scoring has no side effects,
so a retry after a fast failure cannot do harm. Replicas come from :mod:`.discovery`: fixed
addresses, or ``dns:///name:port`` resolved again before each health round (new addresses
join, gone ones are drained and closed).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from serving.gateway import memory, metrics
from serving.gateway.config import HedgeConfig
from serving.gateway.discovery import Discovery
from serving.gateway.errors import BackendError, map_backend_error
from serving.gateway.hedge import Hedger, answered_within
from serving.gateway.replica import Backend, connect, probe_body, probe_problem
from serving.torchserve.client import inference_pb2, predictions_envelope
from serving.torchserve.keys import KeyFileError
from serving.worker.codec import DESCRIBE

logger = logging.getLogger("serving.gateway.backends")
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
DRAIN_S = 30.0  # a replica gone from DNS is closed once its calls end, or after this long


class BackendPool:
    def __init__(
        self,
        targets: str | Sequence[str],
        key_files: str | Sequence[str | Path],
        model_name: str,
        deadline_s: float,
        options: Sequence[tuple[str, Any]] = (),
        deadline_per_mb_s: float = 0.0,
        hedge: HedgeConfig | None = None,
    ) -> None:
        self.discovery = Discovery(targets, key_files)
        # gRPC backs off reconnecting up to 120 s by default: a replica restarted after a long
        # outage would stay out of rotation that long. Retry at least every second instead.
        self._channel_options = [*options, *RECONNECT_OPTIONS]
        self.backends: list[Backend] = []
        self._draining: dict[int, tuple[Backend, float]] = {}  # id -> (backend, since)
        self.join(self.discovery.fixed())
        self.model_name = model_name
        self.hedger = Hedger(hedge or HedgeConfig(ratio=0.0))
        self.deadline_s = deadline_s
        self.deadline_per_mb_s = deadline_per_mb_s
        self._orphans: set[asyncio.Future[Any]] = set()  # losing copies of hedged calls
        self.cordoned: frozenset[str] = frozenset()
        """Targets used only when no other backend is in rotation (the serving plan's
        ``cordon``: a replica busy loading a version)."""
        self._next = 0

    def join(self, replicas: Sequence[tuple[str, Path]]) -> None:
        """Make the backends ``replicas`` (target, key file): new ones are added (out of
        rotation until probed), those not listed leave at once and are closed when their
        calls have ended (:meth:`close_drained`)."""
        wanted = dict(replicas)
        for b in [b for b in self.backends if b.target not in wanted]:
            self.backends.remove(b)
            self._draining[id(b)] = (b, time.monotonic())
            metrics.untrack_backend(b.target)
            logger.info("backend %s removed (%d calls in flight drain)", b.target, b.in_flight)
        known = {b.target for b in self.backends}
        for target, key_file in wanted.items():
            if target in known:
                continue
            backend = connect(target, key_file, self._channel_options)
            self.backends.append(backend)
            metrics.track_backend(backend)
            if self.discovery.dynamic:
                logger.info("backend %s added (key file %s)", target, key_file)

    async def close_drained(self, force: bool = False) -> None:
        """Close the channels of removed backends whose calls ended (all with ``force``)."""
        now = time.monotonic()
        for key, (b, since) in list(self._draining.items()):
            if force or b.in_flight == 0 or now - since > DRAIN_S:
                del self._draining[key]
                await b.channel.close()

    def ready(self, version: str) -> bool:
        """At least one backend is in rotation for ``version``."""
        return any(b.ready.get(version, False) for b in self.backends)

    def pick(self, tried: set[str], version: str) -> Backend | None:
        """The next backend not yet tried: those in rotation for ``version`` first; among them
        the one with the fewest calls in flight (a replica that hangs, e.g. paused, holds only
        the calls it already has), round robin between equals; cordoned ones, and stalled ones
        (a call had to be hedged away from them), only when no other is in rotation."""
        n = len(self.backends)
        order = [self.backends[(self._next + k) % n] for k in range(n)]
        for rank in (0, 1, 2):  # in rotation and not cordoned; in rotation; any
            candidates = [
                b for b in order if b.target not in tried and self._rank(b, version) <= rank
            ]
            if candidates:
                b = min(candidates, key=lambda c: c.in_flight)
                self._next = (self.backends.index(b) + 1) % n
                return b
        return None

    def _rank(self, backend: Backend, version: str) -> int:
        if not backend.ready.get(version, False):
            return 2
        return 1 if backend.stalled or backend.target in self.cordoned else 0

    def timeout(self, body_bytes: int) -> float:
        """The backend deadline of a call: larger bodies take longer to move and score."""
        return self.deadline_s + self.deadline_per_mb_s * body_bytes / 1e6

    def envelope(self, version: str, body_size: int) -> bytes:
        """What goes before an RSB1 body of ``body_size`` bytes in a ``Predictions`` request
        for ``version`` (:meth:`predict` takes the two as one buffer)."""
        return predictions_envelope(self.model_name, version, body_size)

    async def predict(
        self, request: bytes, version: str, time_remaining: float | None
    ) -> tuple[bytes, str]:
        """Score ``request`` (:meth:`envelope` + body, for ``version``) on one backend,
        failing over to another on an outage.

        Returns the prediction and the target of the backend that answered."""
        memory.saw(len(request))  # every scored call, whatever the protocol
        loop = asyncio.get_running_loop()
        end = None if time_remaining is None else loop.time() + time_remaining
        tried: set[str] = set()
        last: BackendError | None = None
        while (backend := self.pick(tried, version)) is not None:
            tried.add(backend.target)
            left = None if end is None else end - loop.time()
            if left is not None and left <= 0:
                break
            own = self.timeout(len(request))
            client_bound = left is not None and left < own
            backend.in_flight += 1
            try:
                started = loop.time()
                limit = left if client_bound and left is not None else own
                reply, answered = await self._first(backend, request, limit, version, tried)
                self.hedger.observe(loop.time() - started)
                answered.calls += 1
                return reply, answered.target
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                    backend.key_due = 0.0  # TorchServe restarted: read its new key
                code, message = map_backend_error(e, client_bound, own)
                timed_out = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                last = BackendError(code, f"{backend.target}: {message}", retry=not timed_out)
            except KeyFileError as e:  # key file unreadable while that TorchServe restarts
                last = BackendError(grpc.StatusCode.UNAVAILABLE, f"{backend.target}: {e}", True)
            finally:
                backend.in_flight -= 1
            if last.code != grpc.StatusCode.UNAVAILABLE:
                raise last
            if backend.ready.get(version, False):
                logger.warning(
                    "backend %s out of rotation for v%s: %s", backend.target, version, last.message
                )
            backend.ready[version] = False
            if not last.retry:
                raise last
            metrics.failover(backend.target)
        if last is None and not self.backends:
            entries = ",".join(e.text for e in self.discovery.entries)
            last = BackendError(grpc.StatusCode.UNAVAILABLE, f"no TorchServe replica: {entries}")
        raise last or BackendError(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")

    async def _first(
        self, backend: Backend, request: bytes, timeout: float, version: str, tried: set[str]
    ) -> tuple[Any, Backend]:
        """``backend``'s answer (the prediction's bytes), or a hedge's (:mod:`.hedge`): when it
        has not answered by the recent tail and another replica in rotation (not tried; a
        stalled or cordoned one only if no other) exists and the budget allows, the call goes there
        too and the first answer wins. With none to go to yet (the others out of rotation or
        stalled, the budget spent), the call looks again after each further tail until its
        deadline: a replica that returns to rotation meanwhile still takes it. A failure of one
        copy waits for the other; both failing raise the first copy's error. Until a hedge is
        sent, the call is awaited as is (no task, no ``asyncio.wait``: one timer, when another
        replica exists)."""
        self.hedger.earn()
        call = self._start(backend, request, timeout)
        delay = self.hedger.delay()
        alone = len(tried) >= len(self.backends)  # no other replica to hedge to, ever
        if delay is None or delay >= timeout or alone or await answered_within(call, delay):
            return await call, backend
        waited = delay
        while (other := self._hedge_target(version, tried)) is None:
            if waited + delay >= timeout:
                logger.debug(
                    "no hedge for a call to %s after %.0f ms", backend.target, waited * 1e3
                )
                return await call, backend
            if await answered_within(call, delay):
                return await call, backend
            waited += delay
        backend.stalled = True  # new calls go elsewhere until it answers a probe
        metrics.hedged(other.target)
        other.in_flight += 1
        primary: asyncio.Future[Any] = asyncio.ensure_future(call)
        second = asyncio.ensure_future(self._call(other, request, timeout - waited))
        copies = {primary: backend, second: other}
        try:
            pending = set(copies)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        if task is primary:  # it beat the replica it was hedged to: slow, not
                            backend.stalled = False  # stalled (else both stall, see pick)
                        return task.result(), copies[task]
            return primary.result(), backend  # both failed: the first copy's error
        finally:
            other.in_flight -= 1
            for task in copies:  # the loser runs out: cancelling leaks (see _orphan)
                if not task.done():
                    self._orphan(task, copies[task])

    def _orphan(self, task: asyncio.Future[Any], backend: Backend) -> None:
        """Keep the losing copy of a hedged call until it ends by itself (its answer, or its
        deadline: both bounded), its outcome dropped. Not cancelled: grpc.aio leaks the
        native batch of a call cancelled in flight (grpc/grpc#43360, ~1 KB per hedge here,
        so a gateway's RSS grew with every hedge), and TorchServe scores a cancelled call
        anyway. It counts in ``backend``'s calls in flight until it ends: a paused replica's
        hung copies keep :meth:`pick` away from it (uncounted, it looked idle and took new
        calls in the chaos run's pause phase)."""
        self._orphans.add(task)
        backend.in_flight += 1

        def ended(t: asyncio.Future[Any]) -> None:
            backend.in_flight -= 1
            self._orphans.discard(t)
            t.cancelled() or t.exception()  # retrieved: no warning

        task.add_done_callback(ended)

    def _hedge_target(self, version: str, tried: set[str]) -> Backend | None:
        """Where a hedge of a call goes now: :meth:`pick`'s choice when it is in rotation (a
        stalled or cordoned one only when no other is); None when there is none or the budget
        is spent."""
        b = self.pick(tried, version)
        if b is None or self._rank(b, version) > 1 or not self.hedger.spend():
            return None
        return b

    def _start(self, backend: Backend, request: bytes, timeout: float | None = None) -> Any:
        """One ``Predictions`` call of a serialized request, started (the grpc call object,
        to await); ``timeout`` None = the backend deadline."""
        return backend.predictions(
            request,
            metadata=backend.metadata(),
            timeout=self.deadline_s if timeout is None else timeout,
        )

    async def _call(self, backend: Backend, request: bytes, timeout: float | None = None) -> Any:
        """One ``Predictions`` call of a serialized request, answered."""
        return await self._start(backend, request, timeout)

    async def probe(self, backend: Backend, version: str, dense: int, sparse: int) -> bool:
        """A one-example call; healthy when it answers one probability in [0, 1]."""
        try:
            body = probe_body(dense, sparse)
            reply = await self._call(backend, self.envelope(version, len(body)) + body)
            problem = probe_problem(reply)
        except (grpc.aio.AioRpcError, KeyFileError) as e:
            problem = str(e.details() if isinstance(e, grpc.aio.AioRpcError) else e)
        if problem and problem != backend.problems.get(version):
            logger.warning(
                "backend %s fails its probe of v%s: %s", backend.target, version, problem
            )
        if problem:
            backend.problems[version] = problem
            if backend.served.pop(version, None) is not None:
                metrics.serving(backend.target, version, None)
        else:
            backend.problems.pop(version, None)
            backend.stalled = False
            if version not in backend.served:
                await self.describe(backend, version)
        return not problem

    async def describe(self, backend: Backend, version: str) -> None:
        """Ask ``backend``'s workers of ``version`` what they serve (the handler answers an
        input named ``describe`` with JSON); a backend that does not say is left unnamed."""
        request = inference_pb2.PredictionsRequest(
            model_name=self.model_name, model_version=version, input={DESCRIBE: b"1"}
        ).SerializeToString()
        try:
            reply = await self._call(backend, request)
            info = json.loads(reply)
            served = {k: str(info[k]) for k in ("device", "variant", "dtype")}
            workers = info.get("workers", 0)  # an older handler does not count them
            backend.workers = workers if type(workers) is int and workers > 0 else backend.workers
        except (grpc.aio.AioRpcError, KeyFileError, ValueError, KeyError, TypeError) as e:
            logger.warning(
                "backend %s does not say what serves v%s: %s", backend.target, version, e
            )
            return
        backend.served[version] = served
        metrics.serving(backend.target, version, served)
        logger.info("backend %s serves v%s: %s", backend.target, version, served)

    def served(self, target: str, version: str) -> dict[str, str]:
        """What ``target`` serves for ``version`` ({} until it said)."""
        for b in self.backends:
            if b.target == target:
                return b.served.get(version, {})
        return {}

    def call_metadata(self, target: str, version: str) -> tuple[tuple[str, str], ...]:
        """The trailing metadata of an answer scored by ``target``: the backend, and what it
        serves (``x-recsys-served: device=cpu variant=int8 dtype=int8``) once it said."""
        served = self.served(target, version)
        described = " ".join(f"{k}={v}" for k, v in served.items())
        return (("x-recsys-backend", target),) + (
            (("x-recsys-served", described),) if served else ()
        )

    async def refresh(self, versions: Sequence[str], dense: int, sparse: int) -> bool:
        """Look the replicas up again (``dns:`` entries), probe every backend for every
        version once (versions no longer listed leave rotation); True when at least one
        backend is in rotation for ``versions[0]`` (the default)."""
        if self.discovery.dynamic:
            self.join(await self.discovery.resolve())
        await self.close_drained()
        pairs = [(b, v) for b in self.backends for v in versions]
        results = await asyncio.gather(*(self.probe(b, v, dense, sparse) for b, v in pairs))
        for (backend, version), ok in zip(pairs, results, strict=True):
            if ok != backend.ready.get(version, False):
                logger.info(
                    "backend %s %s for v%s",
                    backend.target,
                    "in rotation" if ok else "out of rotation",
                    version,
                )
            backend.ready[version] = ok
        for backend in self.backends:
            for gone in set(backend.ready) - set(versions):
                del backend.ready[gone]
                backend.problems.pop(gone, None)
                if backend.served.pop(gone, None) is not None:
                    metrics.serving(backend.target, gone, None)
        return self.ready(versions[0])

    async def close(self) -> None:
        for b in self.backends:
            await b.channel.close()
        await self.close_drained(force=True)
