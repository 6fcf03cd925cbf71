"""Weighted fair sharing of the backends' capacity across tenants (start-time fair queuing).

The capacity is the gateway's budget of work in flight: ``max_examples`` examples and
``max_ids`` sparse ids admitted at once (a 1,000-example request with 64 ids per feature is ~60x
the work of one with 1 id, which a count of examples cannot see). A request's *cost* is the
larger of its two fractions of the budgets, from its own size (the "seats" of Kubernetes' API
Priority and Fairness): a max-size request of 1.66M ids costs 0.4 of a 4M-id budget, a
10-example one ~0.001.

A request that fits in what is free while nobody waits is admitted at once (no queue, no
timer: the path of an idle or fairly used gateway). Otherwise it waits in its tenant's own
queue, and when capacity frees the waiting request with the smallest *start tag* goes next
(SFQ, Goyal et al. 1996): a tenant's request starts at ``max(V, its tenant's last finish)`` and
finishes ``cost / weight`` later; ``V`` is the start tag of the last request admitted. A tenant
that sends more than its share runs its tags ahead of ``V``, so another tenant's request, tagged
at ``V``, goes before its backlog: over time busy tenants get capacity in proportion to their
weights, and a tenant that comes back is not punished for having been idle (tags start at
``V``, not where it left off). The head of the line waits for room rather than letting smaller
requests pass it (a large request is never starved).

While several tenants are *active* (work in flight or queued, or some in the last
:data:`ACTIVE_S`), each holds at most its share (weight / the active tenants' weights) of the
budgets in flight, one request always allowed: a tenant that sends small requests often keeps
room for its next one instead of finding every worker busy with another tenant's max-size
calls (the budgets admit two 1.66M-id requests, one per worker of a 2-worker replica, and a
10-example call then waited up to two seconds for one to end). An idle tenant's share goes to
the busy ones once it has been idle for :data:`ACTIVE_S`.

A tenant's queue is bounded (``queue_cost``: by default one budget's worth of work, and
``queue_calls`` requests): past it only that tenant's requests are refused, RESOURCE_EXHAUSTED
naming the tenant, its share and the budget that binds, while other tenants' are admitted as
usual. A waiting request gives up at its deadline (or ``max_wait_s``) with DEADLINE_EXCEEDED.

Everything runs on the event loop's thread: no locks; each step is O(tenants) at most.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import grpc

from serving.gateway.errors import ScoreError
from serving.gateway.tenants import Tenant

# cost of a request whose size is not known (a unit test's admit without ids): its examples
MIN_COST = 1e-9
# a tenant counts as active (its share is kept for it) this long after its last request
ACTIVE_S = 1.0
# queue waits are histogrammed with these bounds (seconds), +Inf implied
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Place:
    """A call's place at the door while its request arrives: what it is expected to cost, until
    when that counts, and whether it still does."""

    __slots__ = ("cost", "flow", "live", "until")

    def __init__(self, flow: Flow, cost: float, until: float) -> None:
        self.flow, self.cost, self.until, self.live = flow, cost, until, True


class Waiter:
    """A request waiting in its tenant's queue."""

    __slots__ = ("cost", "examples", "future", "ids", "start")

    def __init__(self, examples: int, ids: int, cost: float, start: float) -> None:
        self.examples, self.ids, self.cost, self.start = examples, ids, cost, start
        self.future: asyncio.Future[None] = asyncio.get_running_loop().create_future()


@dataclass(eq=False)
class Flow:
    """One tenant's state: its work in flight, its queue, its tags and its counters."""

    tenant: Tenant
    examples: int = 0
    """Examples admitted and not released."""
    ids: int = 0
    load: float = 0.0
    """Cost admitted and not released (the sum of its requests' costs)."""
    active_at: float = 0.0
    """When it last had a request admitted or ended (monotonic seconds)."""
    queue: deque[Waiter] = field(default_factory=deque)
    queued_cost: float = 0.0
    finish: float = 0.0
    """Finish tag of its last request (virtual time)."""
    admitted: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    """Refusals by reason (queue: over its share with a full queue; deadline: gave up waiting;
    and the door's reasons, counted by the admission module)."""
    waits: list[int] = field(default_factory=lambda: [0] * (len(WAIT_BUCKETS) + 1))
    """Histogram of queue waits (non-cumulative counts per bucket of :data:`WAIT_BUCKETS`)."""
    wait_sum: float = 0.0
    reserved: float = 0.0
    """Cost expected from its calls past the door whose request has not arrived (each counted
    at :attr:`peak_cost`) and whose place has not lapsed (serving/gateway/admission.py)."""
    places: deque[Place] = field(default_factory=deque)
    peak_cost: float = 0.0
    """The largest cost of its requests admitted lately (as of :attr:`peak_at`)."""
    peak_at: float = 0.0

    @property
    def name(self) -> str:
        return self.tenant.name

    @property
    def busy(self) -> bool:
        return bool(self.examples or self.queue)

    def count(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    def waited(self, seconds: float) -> None:
        i = 0
        while i < len(WAIT_BUCKETS) and seconds > WAIT_BUCKETS[i]:
            i += 1
        self.waits[i] += 1
        self.wait_sum += seconds


class FairQueue:
    """The budgets of work in flight, shared by weighted fair queuing across tenants."""

    def __init__(
        self,
        max_examples: int,
        max_ids: int | None = None,
        queue_cost: float = 1.0,
        queue_calls: int = 256,
        max_wait_s: float = 30.0,
        active_s: float = ACTIVE_S,
    ) -> None:
        self.max_examples = max_examples
        self.max_ids = max_ids
        self.queue_cost = queue_cost
        self.queue_calls = queue_calls
        self.max_wait_s = max_wait_s
        self.examples = 0
        self.ids = 0
        self.active_s = active_s
        self.queued = 0
        self.vtime = 0.0
        self.flows: dict[str, Flow] = {}

    # --- sizes ---------------------------------------------------------------------------

    def cost(self, examples: int, ids: int) -> float:
        """A request's share of the budgets: the larger of its two fractions."""
        c = examples / self.max_examples
        if self.max_ids:
            c = max(c, ids / self.max_ids)
        return max(c, MIN_COST)

    def fits(self, examples: int, ids: int) -> bool:
        """Room for it now; with nothing in flight any request fits (the per-request limits
        bound it: one request larger than a budget is served alone)."""
        if not self.examples:
            return True
        if self.examples + examples > self.max_examples:
            return False
        return self.max_ids is None or self.ids + ids <= self.max_ids

    def flow(self, tenant: Tenant) -> Flow:
        f = self.flows.get(tenant.name)
        if f is None:
            f = self.flows[tenant.name] = Flow(tenant)
        elif f.tenant is not tenant:  # the token file was read again (maybe a new weight)
            f.tenant = tenant
        return f

    def share(self, flow: Flow, now: float | None = None) -> float:
        """``flow``'s share of the budgets now: its weight over the active tenants' (its own
        counted as active). Active: work in flight or queued, or some within ``active_s``."""
        now = time.monotonic() if now is None else now
        since = now - self.active_s
        total = sum(
            f.tenant.weight
            for f in self.flows.values()
            if f is not flow and (f.busy or f.active_at > since)
        )
        return flow.tenant.weight / (total + flow.tenant.weight)

    def within_share(self, flow: Flow, cost: float, now: float) -> bool:
        """``flow`` may have a request of ``cost`` more in flight: it has none (one always
        goes), or it stays within its share of the active tenants'. Not work-conserving on
        purpose: a tenant that sends little but often keeps its share of the backends free for
        its next request (a bulk tenant holding every worker made a 10-example call wait for a
        1,000-example one to end); once it is idle for ``active_s`` its share is lent."""
        if not flow.examples or len(self.flows) == 1:
            return True
        share = self.share(flow, now)
        return share >= 1.0 or flow.load + cost <= share + 1e-9

    def queue_full(self, flow: Flow, cost: float = 0.0) -> bool:
        """No room in ``flow``'s queue for a request of ``cost`` (an empty queue always takes
        one)."""
        if not flow.queue:
            return False
        return len(flow.queue) >= self.queue_calls or flow.queued_cost + cost > self.queue_cost

    # --- admission -----------------------------------------------------------------------

    async def acquire(
        self, tenant: Tenant, examples: int, ids: int, time_remaining: float | None
    ) -> float:
        """Admit a request of ``tenant`` (waiting in its queue if need be): seconds waited.
        Raises :class:`ScoreError` (its queue is full; its deadline passed while waiting).
        The caller must :meth:`release` exactly what was admitted."""
        flow = self.flow(tenant)
        cost = self.cost(examples, ids)
        now = time.monotonic()
        if not self.queued and self.fits(examples, ids) and self.within_share(flow, cost, now):
            self._admit(flow, examples, ids, cost, self._start(flow), now)  # nobody waits
            return 0.0
        if self.queue_full(flow, cost):
            flow.count("queue")
            raise self.over_share(flow, examples, ids)
        w = Waiter(examples, ids, cost, self._start(flow))
        flow.finish = w.start + cost / tenant.weight  # the next one starts after this one
        flow.queue.append(w)
        flow.queued_cost += cost
        self.queued += 1
        self.dispatch()
        if w.future.done():  # admitted at once (it was the head and it fit)
            return 0.0
        wait = self.max_wait_s if time_remaining is None else min(time_remaining, self.max_wait_s)
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(max(wait, 0.0)):
                await asyncio.shield(w.future)
        except (TimeoutError, asyncio.CancelledError) as e:
            if w.future.done():  # admitted as it gave up: the caller releases it as usual
                if isinstance(e, asyncio.CancelledError):
                    self.release(tenant, examples, ids)
                    raise
                return time.monotonic() - t0
            self._withdraw(flow, w)
            if isinstance(e, asyncio.CancelledError):
                raise
            flow.count("deadline")
            raise ScoreError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"tenant {tenant.name}: waited {wait * 1e3:.0f} ms in its queue for its share "
                f"of the backends ({self.share(flow):.0%} now) and its deadline ran out",
            ) from None
        waited = time.monotonic() - t0
        flow.waited(waited)
        return waited

    def release(self, tenant: Tenant, examples: int, ids: int) -> None:
        """What :meth:`acquire` admitted is done; the next waiting requests go."""
        flow = self.flow(tenant)
        flow.examples -= examples
        flow.ids -= ids
        flow.load = max(0.0, flow.load - self.cost(examples, ids)) if flow.examples else 0.0
        flow.active_at = time.monotonic()
        self.examples -= examples
        self.ids -= ids
        if self.queued:
            self.dispatch()

    def dispatch(self) -> None:
        """Admit waiting requests in start-tag order while the head one fits; a tenant at its
        share (:meth:`within_share`) is passed over until its own calls end."""
        now = time.monotonic()
        while self.queued:
            head: Flow | None = None
            for f in self.flows.values():
                if (
                    f.queue
                    and (head is None or f.queue[0].start < head.queue[0].start)
                    and self.within_share(f, f.queue[0].cost, now)
                ):
                    head = f
            if head is None:
                return
            w = head.queue[0]
            if not self.fits(w.examples, w.ids):
                return
            self._dequeue(head, w)
            self._admit(head, w.examples, w.ids, w.cost, w.start, now, tagged=True)
            w.future.set_result(None)

    def over_share(self, flow: Flow, examples: int, ids: int) -> ScoreError:
        """The refusal of a request of ``flow`` over its share with its queue full."""
        share = self.share(flow)
        e_used = flow.examples + sum(w.examples for w in flow.queue) + examples
        i_used = flow.ids + sum(w.ids for w in flow.queue) + ids
        by_ids = self.max_ids is not None and i_used / self.max_ids > e_used / self.max_examples
        budget = (
            f"the ids budget binds (max_inflight_ids {self.max_ids:,})"
            if by_ids
            else f"the examples budget binds (max_inflight_examples {self.max_examples:,})"
        )
        return ScoreError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"tenant {flow.name} is over its share: {flow.examples:,} examples and "
            f"{flow.ids:,} ids in flight, {len(flow.queue)} calls queued; its share now is "
            f"{share:.0%} of the budgets and {budget}; retry with backoff",
        )

    # --- internals -----------------------------------------------------------------------

    def _start(self, flow: Flow) -> float:
        return max(self.vtime, flow.finish)

    def _admit(
        self,
        flow: Flow,
        examples: int,
        ids: int,
        cost: float,
        start: float,
        now: float,
        tagged: bool = False,
    ) -> None:
        if not tagged:
            flow.finish = start + cost / flow.tenant.weight
        self.vtime = max(self.vtime, start)
        flow.load += cost
        flow.active_at = now
        flow.examples += examples
        flow.ids += ids
        flow.admitted += 1
        self.examples += examples
        self.ids += ids

    def _withdraw(self, flow: Flow, w: Waiter) -> None:
        """A waiting request gave up: out of its queue (its tag is left spent: it was the
        tenant's), and the line moves if it was the head."""
        if w not in flow.queue:
            return
        self._dequeue(flow, w)
        self.dispatch()

    def _dequeue(self, flow: Flow, w: Waiter) -> None:
        """``w`` leaves ``flow``'s queue (admitted or gone): the counts follow."""
        flow.queue.remove(w)  # the head when admitted: O(1)
        flow.queued_cost = max(0.0, flow.queued_cost - w.cost) if flow.queue else 0.0
        self.queued -= 1
