"""A lite worker reached over its Unix socket (``backend`` entry ``lite:PATH``), as a channel
the backend pool uses like a gRPC one: ``predictions(request, metadata=, timeout=)`` returns
an awaitable call (an asyncio future: ``done``, ``add_done_callback``, ``cancel``), and a
failure is the ``grpc.aio.AioRpcError`` a gRPC call would raise (UNAVAILABLE when the worker
is unreachable or its connection ends, PERMISSION_DENIED for a stale key, DEADLINE_EXCEEDED),
so failover, hedging and key re-reads work unchanged (serving/gateway/backends.py).

One connection per worker; calls are pipelined on it and answered in order (the frames:
serving/lite/frames.py), at most :data:`AHEAD` at a time; the rest wait here, and one whose
deadline passes meanwhile is never sent. A call that times out or is cancelled after it was
written keeps its place: its answer is read and dropped. A refused key ends the connection
(the calls behind it fail UNAVAILABLE and fail over; the pool re-reads the key file). The
connection is made on the first call after none is open; a failure to connect, or a lost
connection, fails every call waiting at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import grpc

from serving.lite.frames import REPLY, REQUEST, FrameTooLarge, cut

AHEAD = 2
"""Calls written to a worker and not answered yet, at most: the one it scores and the next,
so it never waits out a round trip. The rest wait here, where one whose deadline passes is
never sent (the coalescer sends requests of ``alone_examples`` or more at once, whatever is
in flight). With no bound, 1,000-example requests of 64 callers cost the gateway 2.7-2.8 ms
of CPU each, 2.2 with it (``python -m serving.bench --methods gateway-lite --sizes 1000``,
same throughput within noise)."""
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_EMPTY = grpc.aio.Metadata()


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, _EMPTY, _EMPTY, details)


def _fail(future: asyncio.Future[Any], code: grpc.StatusCode, details: str) -> None:
    if not future.done():
        future.set_exception(rpc_error(code, details))


class _Connection(asyncio.Protocol):
    """One open connection: requests written as the window allows, answers matched in order."""

    def __init__(self, channel: SocketChannel) -> None:
        self.channel = channel
        self.pending: deque[asyncio.Future[bytes]] = deque()
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.problem = ""
        """Why this side ended the connection (a malformed answer, a refused key)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def pump(self) -> None:
        """Write waiting calls while fewer than :data:`AHEAD` are unanswered (expired and
        cancelled ones are dropped unsent)."""
        waiting, transport = self.channel.waiting, self.transport
        assert transport is not None
        while waiting and len(self.pending) < AHEAD:
            request, deadline, future = waiting.popleft()
            if not future.done():
                transport.writelines((REQUEST.pack(len(request), deadline), request))
                self.pending.append(future)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            try:
                frame = cut(self.buf, REPLY)
            except FrameTooLarge as e:
                self._broken(f"a malformed answer: {e}")
                return
            if frame is None:
                break
            (_, status), payload = frame
            if not self.pending:
                self._broken("an answer to no call")
                return
            future = self.pending.popleft()
            if future.done():  # timed out or cancelled: its answer is dropped
                continue
            if status == 0:
                future.set_result(payload)
                continue
            code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
            future.set_exception(rpc_error(code, payload.decode("utf-8", "replace")))
            if code == grpc.StatusCode.PERMISSION_DENIED:  # a stale key: the next call
                self._broken("it refused the key")  # connects again with a fresh one
                return
        self.pump()

    def _broken(self, why: str) -> None:
        assert self.transport is not None
        self.problem = why
        self.transport.abort()  # connection_lost fails the calls

    def connection_lost(self, exc: Exception | None) -> None:
        if self.channel.connection is self:
            self.channel.connection = None
        why = self.problem or (str(exc) if exc else "it closed the connection")
        why = f"lite worker {self.channel.path}: {why}"
        # the unanswered calls and those waiting to be written: the worker is gone (or
        # refused us); they fail over now rather than wait for a reconnection
        while self.pending:
            _fail(self.pending.popleft(), grpc.StatusCode.UNAVAILABLE, why)
        self.channel.fail_waiting(why)


class SocketChannel:
    """Calls to one lite worker's socket at ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.connection: _Connection | None = None
        self.waiting: deque[tuple[bytes, float, asyncio.Future[bytes]]] = deque()
        """Calls not written yet: no connection yet, or :data:`AHEAD` unanswered."""
        self._connecting: asyncio.Task[None] | None = None
        self._closed = False

    def predictions(
        self,
        request: bytes,
        metadata: Sequence[tuple[str, str]] = (),
        timeout: float | None = None,
    ) -> asyncio.Future[bytes]:
        """One call of a serialized ``PredictionsRequest``: a future of the prediction's bytes."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bytes] = loop.create_future()
        deadline = 0.0
        if timeout is not None:
            deadline = time.time() + timeout
            timer = loop.call_later(timeout, _fail, future, grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "Deadline Exceeded")  # fmt: skip
            future.add_done_callback(lambda _: timer.cancel())
        if self._closed:
            _fail(future, grpc.StatusCode.UNAVAILABLE, f"lite worker {self.path}: channel closed")
            return future
        self.waiting.append((request, deadline, future))
        if (connection := self.connection) is not None:
            connection.pump()
        elif self._connecting is None:
            self._connecting = loop.create_task(self._connect(metadata))
        return future

    async def _connect(self, metadata: Sequence[tuple[str, str]]) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_unix_connection(lambda: _Connection(self), self.path)
        except OSError as e:
            self.fail_waiting(f"lite worker {self.path}: {e.strerror or e}")
            return
        finally:
            self._connecting = None
        assert connection.transport is not None
        hello = dict(metadata).get("authorization", "").encode()
        connection.transport.write(REQUEST.pack(len(hello), 0.0) + hello)
        self.connection = connection
        connection.pump()

    def fail_waiting(self, why: str) -> None:
        """Fail every call not written yet: UNAVAILABLE, ``why``."""
        while self.waiting:
            _fail(self.waiting.popleft()[2], grpc.StatusCode.UNAVAILABLE, why)

    async def close(self) -> None:
        self._closed = True
        if self.connection is not None and self.connection.transport is not None:
            self.connection.transport.close()
        self.fail_waiting(f"lite worker {self.path}: channel closed")
