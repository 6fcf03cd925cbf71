"""Adaptive request coalescing: concurrent ``Score`` calls become one TorchServe call.

The cost of a TorchServe call is per call (Java frontend, worker socket, Python decode), not
per example (see docs/architecture.md), so the gateway merges what arrives while it is busy:

- A call starts at once when fewer than ``slots`` backend calls are in flight: a lone request
  never waits (no timer), and goes out from its caller's own task, as is. So does a request of
  at least ``alone_examples`` examples whatever is in flight: it is a call's worth of work on
  its own, and merging it would only copy it.
- Otherwise it queues; when a backend call finishes, everything queued (up to
  ``max_examples`` examples) leaves as ONE call, in arrival order. Up to ``deck`` more calls
  may leave before one finishes, each carrying two or more queued requests: they wait in
  TorchServe's queue, so a worker that finishes starts the next call at once instead of
  waiting out the round trip to the gateway, and a lone request still never waits for one.
- Each caller gets exactly its own scores, in order. A member whose deadline has passed before
  its batch leaves gets DEADLINE_EXCEEDED alone; the merged call's deadline is the latest
  member's (a member that gives up earlier is cancelled by gRPC, the others are not affected).
- Validation happens before a request gets here: nothing invalid joins a batch.

Shapes: ``B`` examples, ``F`` sparse features, ``N`` ids; ``values`` are grouped feature-major
(all ids of feature 0, then feature 1, ...), as in the artifact's signature; members are joined
by ``serving.worker.codec.merge`` (the worker joins a TorchServe batch with it too).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from serving.gateway import metrics
from serving.worker.codec import Arrays, merge

logger = logging.getLogger("serving.gateway.coalesce")
# (merged arrays, time remaining or None) -> (scores f32[B], backend that answered); a reply
# with another number of scores must raise (ScoreCountError), never return
Send = Callable[[Arrays, float | None], Awaitable[tuple[np.ndarray, str]]]


class Expired(Exception):
    """The member's deadline passed before its batch left."""


class ScoreCountError(ValueError):
    """The backend returned another number of scores than the call had examples."""


# merges of more array bytes than this run in a thread: health checks and refusals keep
# flowing on the event loop while megabytes are copied
OFFLOAD_BYTES = 1 << 20


def split(scores: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """``scores f32[sum(sizes)]`` -> one array per member, in order."""
    out, start = [], 0
    for n in sizes:
        out.append(scores[start : start + n])
        start += n
    return out


@dataclass
class Member:
    arrays: Arrays
    deadline: float | None  # loop time, None = no deadline
    future: asyncio.Future[tuple[np.ndarray, str]]
    examples: int = field(init=False)
    nbytes: int = field(init=False)
    """Size of the member's arrays as they travel (int32 lengths, int64 ids)."""

    def __post_init__(self) -> None:
        dense, values, lengths = self.arrays
        self.examples = int(dense.shape[0])
        self.nbytes = 4 * dense.size + 4 * lengths.size + 8 * values.size


@dataclass
class Stats:
    calls: int = 0
    """Backend calls made."""
    requests: int = 0
    """Requests answered through them."""
    largest: int = 0
    """Most examples in one backend call."""


class Coalescer:
    """Merges concurrent requests for one model version into backend calls (see module doc).

    ``send``: one backend call; ``slots``: backend calls in flight before requests queue (e.g.
    one per TorchServe worker); ``deck``: merged calls allowed beyond them (see the module
    doc); ``max_examples`` / ``max_bytes``: most examples / array bytes per
    backend call (a single request above them goes alone: it was validated against the request
    limits already).
    """

    def __init__(
        self,
        send: Send,
        slots: int,
        max_examples: int,
        max_bytes: int | None = None,
        alone_examples: int = 0,
        deck: int = 0,
    ) -> None:
        if slots < 1 or max_examples < 1:
            raise ValueError("slots and max_examples must be >= 1")
        self.send = send
        self.slots = slots
        self.deck = deck
        self.max_examples = max_examples
        self.max_bytes = max_bytes
        self.alone_examples = alone_examples or 1 << 62  # 0: none goes alone for its size
        self.queue: deque[Member] = deque()
        self.in_flight = 0
        self.stats = Stats()
        self._tasks: set[asyncio.Task[None]] = set()  # referenced until done

    async def score(self, arrays: Arrays, time_remaining: float | None) -> tuple[np.ndarray, str]:
        """This request's scores ``f32[B]`` and the backend that answered; raises what the
        backend call raised, or :class:`Expired`."""
        large = len(arrays[0]) >= self.alone_examples
        if large or (self.in_flight < self.slots and not self.queue):
            return await self._alone(arrays, time_remaining)
        loop = asyncio.get_running_loop()
        deadline = None if time_remaining is None else loop.time() + time_remaining
        member = Member(arrays, deadline, loop.create_future())
        self.queue.append(member)
        self.dispatch()
        return await member.future

    async def _alone(self, arrays: Arrays, time_remaining: float | None) -> tuple[np.ndarray, str]:
        """A call with a free slot and no queue ahead of it, or a large one: sent from the
        caller's own task, as is (no member, future, task or merge: what a request costs when
        there is nothing to merge it with); the calls that queue meanwhile leave when it ends."""
        if time_remaining is not None and time_remaining <= 0:
            raise Expired("the deadline passed while queued")
        examples = int(arrays[0].shape[0])
        self._count(1, examples)
        self.in_flight += 1
        try:
            return await self.send(arrays, time_remaining)
        finally:
            self.in_flight -= 1
            self.dispatch()

    def _count(self, requests: int, examples: int) -> None:
        logger.debug("backend call: %d requests, %d examples", requests, examples)
        self.stats.calls += 1
        self.stats.requests += requests
        self.stats.largest = max(self.stats.largest, examples)
        metrics.backend_call(requests, examples)

    def dispatch(self) -> None:
        """Start backend calls while slots are free and requests wait, and merged ones on deck
        while two or more wait."""
        while self.queue and (
            self.in_flight < self.slots
            or (self.in_flight < self.slots + self.deck and len(self.queue) >= 2)
        ):
            batch = self._take()
            if batch:
                self.in_flight += 1
                task = asyncio.get_running_loop().create_task(self._call(batch))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[Member]:
        """The next batch: queued members in order, up to ``max_examples`` (at least one)."""
        now = asyncio.get_running_loop().time()
        batch: list[Member] = []
        total = size = 0
        while self.queue:
            m = self.queue[0]
            if m.future.done():  # the caller went away (cancelled)
                self.queue.popleft()
                continue
            if m.deadline is not None and m.deadline <= now:
                self.queue.popleft()
                m.future.set_exception(Expired("the deadline passed while queued"))
                continue
            if batch and total + m.examples > self.max_examples:
                break
            if batch and self.max_bytes is not None and size + m.nbytes > self.max_bytes:
                break
            batch.append(self.queue.popleft())
            total += m.examples
            size += m.nbytes
        return batch

    async def _call(self, batch: list[Member]) -> None:
        sizes = [m.examples for m in batch]
        try:
            scores, backend = await self._merged(batch, sizes)
        except Exception as e:  # every member gets the backend's error
            self._release()
            for m in batch:
                if not m.future.done():
                    m.future.set_exception(e)
            return
        except BaseException:
            self._release()
            raise
        # the slot is given to the next batch before the members wake: its task runs ahead of
        # theirs, so the backend's worker is not kept waiting while their answers are built
        self._release()
        for m, part in zip(batch, split(scores, sizes), strict=True):
            if not m.future.done():
                m.future.set_result((part, backend))

    async def _merged(self, batch: list[Member], sizes: list[int]) -> tuple[np.ndarray, str]:
        """One backend call for ``batch``: merged, sent, answered."""
        loop = asyncio.get_running_loop()
        deadlines = [m.deadline for m in batch if m.deadline is not None]
        remaining = max(deadlines) - loop.time() if len(deadlines) == len(batch) else None
        self._count(len(batch), sum(sizes))
        parts = [m.arrays for m in batch]
        if len(parts) > 1 and sum(m.nbytes for m in batch) > OFFLOAD_BYTES:
            merged = await asyncio.to_thread(merge, parts)  # numpy copies free the loop
        else:
            merged = merge(parts)
        return await self.send(merged, remaining)

    def _release(self) -> None:
        """A backend call ended: its slot goes to what is queued."""
        self.in_flight -= 1
        self.dispatch()
