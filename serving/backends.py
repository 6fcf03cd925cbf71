"""TorchServe backends behind one gateway: health-aware round robin with failover.

Each backend has its own channel, key file (TorchServe writes new keys at every start) and
health, kept by a probe loop that sends a one-example request every interval. Calls go round
robin over the healthy backends (over all of them while none is known healthy). A call that
fails as an outage (unreachable, no worker, no answer within the backend deadline, a stale key)
marks its backend unhealthy and is retried once on the next one while the client's deadline
allows, so stopping one replica costs at most the calls already waiting on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from serving import metrics
from serving.codec import encode_request
from serving.torchserve.client import inference_stub, predictions_request
from serving.torchserve.keys import KeyFileError, KeySource

logger = logging.getLogger("serving.backends")
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
_UNAVAILABLE_HINTS = ("worker", "not found", "unavailable", "503", "no worker", "connect")


class BackendError(Exception):
    """A failed backend call, already mapped to the gateway's status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def probe_body(dense: int, sparse: int) -> bytes:
    """A one-example request (zeros, no ids) of the schema's shape: the health probe."""
    return encode_request(
        np.zeros((1, dense), np.float32), np.zeros(0, np.int64), np.zeros((sparse, 1), np.int32)
    )


def map_backend_error(
    e: grpc.aio.AioRpcError, client_bound: bool = False, deadline_s: float = 0.0
) -> tuple[grpc.StatusCode, str]:
    """TorchServe's status -> ours.

    Outages are UNAVAILABLE (retryable): connection refused, a model without a live worker, and
    no answer within the gateway's own backend deadline (as proxies map an upstream timeout).
    DEADLINE_EXCEEDED only when the client's deadline was the one that ran out.
    """
    code, details = e.code(), (e.details() or "").strip()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        if client_bound:
            return code, "the call's deadline passed while TorchServe was scoring"
        return grpc.StatusCode.UNAVAILABLE, (
            f"TorchServe did not answer within {deadline_s:g}s: its workers are down, restarting or overloaded"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return code, f"TorchServe is unreachable: {details or code.name}"
    if code == grpc.StatusCode.PERMISSION_DENIED:  # keys rotate when TorchServe restarts
        return grpc.StatusCode.UNAVAILABLE, f"TorchServe refused the gateway's key: {details}"
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED) or any(
        h in details.lower() for h in _UNAVAILABLE_HINTS
    ):
        return grpc.StatusCode.UNAVAILABLE, f"TorchServe: {details or code.name}"
    return grpc.StatusCode.INTERNAL, f"TorchServe failed: {code.name}: {details}"


@dataclass
class Backend:
    target: str
    keys: KeySource
    channel: grpc.aio.Channel
    stub: Any
    healthy: bool = False
    calls: int = field(default=0)


class BackendPool:
    def __init__(
        self,
        targets: Sequence[str],
        key_files: Sequence[Path],
        model_name: str,
        deadline_s: float,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        files = list(key_files) * len(targets) if len(key_files) == 1 else list(key_files)
        # gRPC backs off reconnecting up to 120 s by default: a replica restarted after a long
        # outage would stay out of rotation that long. Retry at least every second instead.
        channel_options = [*options, *RECONNECT_OPTIONS]
        self.backends = []
        for target, key_file in zip(targets, files, strict=True):
            channel = grpc.aio.insecure_channel(target, options=channel_options)
            stub = inference_stub(channel)
            self.backends.append(Backend(target, KeySource(key_file), channel, stub))
        self.model_name = model_name
        self.deadline_s = deadline_s
        self._next = 0

    def pick(self, tried: set[int]) -> int | None:
        """Next backend by round robin: healthy ones first, then any not yet tried."""
        n = len(self.backends)
        order = [(self._next + k) % n for k in range(n)]
        for wanted in (True, False):
            for i in order:
                if i not in tried and (self.backends[i].healthy or not wanted):
                    self._next = (i + 1) % n
                    return i
        return None

    async def predict(
        self, body: bytes, version: str, time_remaining: float | None
    ) -> tuple[bytes, str]:
        """Score ``body`` on one backend, failing over to another on an outage.

        Returns the prediction and the target of the backend that answered."""
        loop = asyncio.get_running_loop()
        end = None if time_remaining is None else loop.time() + time_remaining
        tried: set[int] = set()
        last: BackendError | None = None
        while (i := self.pick(tried)) is not None:
            tried.add(i)
            backend = self.backends[i]
            left = None if end is None else end - loop.time()
            if left is not None and left <= 0:
                break
            client_bound = left is not None and left < self.deadline_s
            try:
                reply = await self._call(backend, version, body, left if client_bound else None)
                backend.calls += 1
                return bytes(reply.prediction), backend.target
            except grpc.aio.AioRpcError as e:
                code, message = map_backend_error(e, client_bound, self.deadline_s)
                last = BackendError(code, f"{backend.target}: {message}")
            except KeyFileError as e:  # key file unreadable while that TorchServe restarts
                last = BackendError(grpc.StatusCode.UNAVAILABLE, f"{backend.target}: {e}")
            if last.code != grpc.StatusCode.UNAVAILABLE:
                raise last
            metrics.failover(backend.target)
            if backend.healthy:
                logger.warning("backend %s out of rotation: %s", backend.target, last.message)
            backend.healthy = False
        raise last or BackendError(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")

    async def _call(
        self, backend: Backend, version: str, body: bytes, timeout: float | None = None
    ) -> Any:
        """One ``Predictions`` call; ``timeout`` None = the backend deadline."""
        return await backend.stub.Predictions(
            predictions_request(self.model_name, version, body),
            metadata=backend.keys.metadata(),
            timeout=self.deadline_s if timeout is None else timeout,
        )

    async def probe(self, backend: Backend, version: str, dense: int, sparse: int) -> bool:
        try:
            await self._call(backend, version, probe_body(dense, sparse))
            return True
        except (grpc.aio.AioRpcError, KeyFileError):
            return False

    async def refresh(self, version: str, dense: int, sparse: int) -> bool:
        """Probe every backend once; True when at least one is healthy."""
        results = await asyncio.gather(
            *(self.probe(b, version, dense, sparse) for b in self.backends)
        )
        for backend, ok in zip(self.backends, results, strict=True):
            if ok != backend.healthy:
                logger.info(
                    "backend %s %s", backend.target, "in rotation" if ok else "out of rotation"
                )
            backend.healthy = ok
        return any(results)

    async def close(self) -> None:
        for b in self.backends:
            await b.channel.close()
