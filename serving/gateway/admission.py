"""Overload control at the gateway's door: each tenant gets its share, and only the one over it
is refused.

Three rules, the first two before a request's bytes are read or decoded:

- **Fair shares of work in flight** (serving/gateway/fair.py): the budgets of examples
  (``limits.max_inflight_examples``) and ids (``limits.max_inflight_ids``) are shared by
  weighted fair queuing across tenants (a token's tenant: serving/gateway/tenants.py). A request
  that fits while nobody waits goes at once; otherwise it waits in its tenant's own bounded
  queue and the next free capacity goes to the tenant furthest under its share. A tenant whose
  queue is full is refused with RESOURCE_EXHAUSTED naming it, its share and the budget that
  binds; the others are not (before: one tenant's 16 loops of max-size requests shut the door on
  everyone, a second client's calls succeeded 0.24% of the time).
- **The door, per tenant** (:class:`AdmissionInterceptor`, REST's ``infer``): a call's tenant is
  known from its token before its request is read. Its calls still receiving their request hold
  a place each, counted at the tenant's own largest recent request (:data:`PEAK_WINDOW_S`, then
  fading, and all of them together for at most :data:`RESERVED_SHARE` of its queue); a call
  arriving when the tenant's queue and places already hold a queue's worth is refused before
  its upload. A call is charged by its own size once it arrives (the gRPC message,
  HTTP Content-Length), never by another tenant's history. Places lapse after
  ``limits.door_hold_s`` (idle streams hold nothing for long), and a call whose request has not
  arrived within ``limits.read_timeout_s`` ends DEADLINE_EXCEEDED, freeing its stream.
- **A deadline that cannot be met**: while requests are in flight, one whose remaining deadline
  is shorter than the backends' recent call latency is refused at once with DEADLINE_EXCEEDED.
  The estimate cannot wedge the gate: an exponentially weighted average of every backend call,
  failures and timeouts included; it decays with time since the last call (half-life
  :data:`LATENCY_HALF_LIFE_S`); with nothing in flight a request always goes through.
  :meth:`Admission.refusing_all` tells health when the gate has refused every call for a while.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import grpc

from serving.gateway import metrics, tenants
from serving.gateway.errors import ScoreError
from serving.gateway.fair import FairQueue, Flow, Place
from serving.gateway.peers import PeerLimit
from serving.gateway.rpc import WrappingInterceptor
from serving.gateway.tenants import Tenant
from serving.gateway.validate import Limits

# weight of the newest backend call in the latency average: ~the last 10 calls matter
EWMA_WEIGHT = 0.1
# a place at the door counts as its tenant's largest request admitted in this window (seconds),
# halving every window after it without a new admission
PEAK_WINDOW_S = 10.0
# the latency estimate halves every this many seconds without a backend call to refresh it
LATENCY_HALF_LIFE_S = 2.0
# health says NOT_SERVING when the deadline gate refused every call for this long (and at least
# REFUSING_ALL_MIN calls): a gateway that only refuses should be taken out of rotation
REFUSING_ALL_S = 5.0
REFUSING_ALL_MIN = 20
# a tenant's places at the door count for at most this share of its queue: the rest is always
# open to its calls past the door, whatever its idle streams hold
RESERVED_SHARE = 0.5
# a tenant's refusals over its share are answered at once up to this rate (a bucket of
# REFUSAL_BURST); past it each waits REFUSAL_DELAY_S (Admission.pace). 64 callers of the
# largest request backing off 50 ms -> 1 s are refused ~55 times a second: never paced
REFUSALS_PER_S, REFUSAL_BURST, REFUSAL_DELAY_S = 100.0, 200.0, 0.5
# how long a place at the door counts (seconds), and how long a call may take to send its
# request: the gateway's limits say (these are their defaults)
DOOR_HOLD_S = Limits.door_hold_s
READ_TIMEOUT_S = Limits.read_timeout_s

# the place a call holds at the door, per task: admit() converts it into the call's real size
_DOOR: contextvars.ContextVar[Place | None] = contextvars.ContextVar("admission_door", default=None)
Identify = Callable[[Sequence[tuple[str, Any]] | None], Tenant]


def aged(peak: float, at: float, now: float) -> float:
    """``peak`` (set at ``at``) as the door counts it at ``now``: whole for
    :data:`PEAK_WINDOW_S`, then halving every window (a peak no admission renews fades)."""
    age = now - at
    if age <= PEAK_WINDOW_S:
        return peak
    return peak * 0.5 ** ((age - PEAK_WINDOW_S) / PEAK_WINDOW_S)


class Admission:
    """The fair budgets, the door and the backends' recent latency (one per gateway)."""

    def __init__(
        self,
        max_examples: int,
        max_ids: int | None = None,
        hold_s: float = DOOR_HOLD_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        queue_cost: float = 1.0,
        queue_calls: int = 256,
    ) -> None:
        self.fair = FairQueue(max_examples, max_ids, queue_cost, queue_calls)
        self.hold_s = hold_s
        """How long a place at the door counts: the time a request should take to arrive."""
        self.read_timeout_s = read_timeout_s
        """How long a call past the door may take to send its request (then DEADLINE_EXCEEDED)."""
        self.latency_s = 0.0
        """Backend call latency, seconds, as of :attr:`latency_at` (read it via :meth:`latency`)."""
        self.latency_at = 0.0
        self.deadline_refusals = 0
        """Consecutive deadline refusals since the last admission."""
        self.refusals = PeerLimit(REFUSALS_PER_S, REFUSAL_BURST, REFUSAL_DELAY_S)
        """Each tenant's bucket of immediate refusals (:meth:`pace`)."""
        self.last_admit_at = 0.0
        self.refused = 0

    @property
    def in_flight(self) -> int:
        """Examples admitted now (all tenants)."""
        return self.fair.examples

    @property
    def ids_in_flight(self) -> int:
        return self.fair.ids

    # --- after the request arrived ---------------------------------------------------------

    async def admit(self, examples: int, time_remaining: float | None, ids: int = 0) -> None:
        """Admit a request of the current tenant (:func:`tenants.current`), waiting in its
        queue for its share if need be, or raise :class:`ScoreError`; the caller must
        :meth:`release` exactly what was admitted."""
        self.check(examples, time_remaining)
        tenant = tenants.current()
        flow = self.fair.flow(tenant)
        place = _DOOR.get()
        if place is not None:  # this call's place at the door becomes its real size
            if place.live:
                _drop(place)
            _DOOR.set(None)
        try:
            await self.fair.acquire(tenant, examples, ids, time_remaining)
        except ScoreError as e:
            self.count("overload" if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "deadline")
            raise
        now = time.monotonic()
        self.deadline_refusals, self.last_admit_at = 0, now
        cost = self.fair.cost(examples, ids)
        if cost >= aged(flow.peak_cost, flow.peak_at, now):
            flow.peak_cost, flow.peak_at = cost, now

    def check(self, examples: int, time_remaining: float | None) -> None:
        """Raise :class:`ScoreError` when the request would be refused at once (reserves
        nothing): its tenant's queue cannot take it, or its deadline is shorter than the
        backends' latency. Lets a request be refused before the work of decoding it."""
        fair = self.fair
        flow = fair.flow(tenants.current())
        waits = fair.queued or not fair.fits(examples, 0)
        if waits and fair.queue_full(flow, fair.cost(examples, 0)):
            flow.count("queue")
            raise self.refusal(error=fair.over_share(flow, examples, 0))
        # with nothing in flight the call goes through whatever the estimate says: it is the
        # probe that corrects an estimate no longer true (the gate never refuses on its own say)
        if time_remaining is not None and fair.examples:
            latency = self.latency()
            if time_remaining < latency:
                self.deadline_refusals += 1
                flow.count("deadline")
                raise self.refusal(
                    "deadline",
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the remaining deadline ({time_remaining * 1e3:.1f} ms) is shorter than "
                    f"the backends' recent latency ({latency * 1e3:.1f} ms)",
                )

    def release(self, examples: int, ids: int = 0) -> None:
        self.fair.release(tenants.current(), examples, ids)

    def count(self, reason: str) -> None:
        self.refused += 1
        metrics.rejected(reason)

    def refusal(
        self,
        reason: str = "overload",
        code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED,
        message: str = "",
        error: ScoreError | None = None,
    ) -> ScoreError:
        """A refusal, counted (here and in the rejections metric by ``reason``)."""
        self.count(reason)
        return error or ScoreError(code, message)

    # --- the door: before the request is read ------------------------------------------------

    def door_full(self, tenant: Tenant, now: float | None = None) -> bool:
        """No room for one more call of ``tenant`` to upload: its queue and its calls still
        receiving hold a queue's worth (:attr:`FairQueue.queue_cost`) with this one."""
        now = time.monotonic() if now is None else now
        flow = self.fair.flow(tenant)
        _lapse(flow, now)
        queue = self.fair.queue_cost
        held = flow.queued_cost + min(flow.reserved, RESERVED_SHARE * queue)
        if not held:
            return False
        return held + aged(flow.peak_cost, flow.peak_at, now) > queue

    def door_refusal(self, tenant: Tenant) -> ScoreError:
        """The door's refusal of a call of ``tenant`` (counted)."""
        flow = self.fair.flow(tenant)
        flow.count("door")
        return self.refusal(
            message=f"tenant {tenant.name} is over its share: {len(flow.queue)} calls queued "
            f"and {len(flow.places)} still sending their request hold its queue "
            f"(limits.tenant_queue_share {self.fair.queue_cost:g} of the budgets; its share "
            f"now is {self.fair.share(flow):.0%}); retry with backoff"
        )

    async def pace(self, tenant: Tenant) -> None:
        """Before a refusal of ``tenant`` over its share is answered: at once within its bucket
        of refusals (:data:`REFUSALS_PER_S`: clients that back off stay in it), after
        :data:`REFUSAL_DELAY_S` past it. A tenant that loops on its refusals without backing
        off cost the gateway a core answering 300 a second (16 loops of 1.7 MB requests, each
        partly uploaded and TLS-decrypted before its refusal) and the other tenants' latency
        with it; paced, its loops make a few calls a second."""
        await self.refusals.refuse(tenant.name)

    def enter(self, tenant: Tenant) -> contextvars.Token[Place | None]:
        """A call of ``tenant`` passes the door: it holds a place at the tenant's recent peak
        cost for :attr:`hold_s` at most, until :meth:`admit` (same task) or :meth:`leave`."""
        now = time.monotonic()
        flow = self.fair.flow(tenant)
        place = Place(flow, aged(flow.peak_cost, flow.peak_at, now), now + self.hold_s)
        flow.reserved += place.cost
        flow.places.append(place)
        return _DOOR.set(place)

    def leave(self, token: contextvars.Token[Place | None]) -> None:
        """The call is done: drop its place at the door if :meth:`admit` did not take it."""
        place = _DOOR.get()
        if place is not None and place.live:
            _drop(place)
        _DOOR.reset(token)

    # --- the backends' latency -----------------------------------------------------------

    def latency(self, now: float | None = None) -> float:
        """The backends' recent call latency (seconds), decayed by the time since the last
        call ended: halves every :data:`LATENCY_HALF_LIFE_S` without news."""
        if not self.latency_s:
            return 0.0
        age = (time.monotonic() if now is None else now) - self.latency_at
        return self.latency_s * 0.5 ** (max(age, 0.0) / LATENCY_HALF_LIFE_S)

    def observe(self, seconds: float) -> None:
        """A backend call ended after ``seconds``: answered, failed or timed out alike (a
        timeout's elapsed time is a lower bound of the latency, which is what it teaches)."""
        now = time.monotonic()
        current = self.latency(now)
        self.latency_s = seconds if not current else current + EWMA_WEIGHT * (seconds - current)
        self.latency_at = now

    def refusing_all(self, now: float | None = None) -> bool:
        """The deadline gate refused every call (at least :data:`REFUSING_ALL_MIN`) for the
        last :data:`REFUSING_ALL_S`: health should say so rather than SERVING."""
        now = time.monotonic() if now is None else now
        return (
            self.deadline_refusals >= REFUSING_ALL_MIN
            and now - self.last_admit_at >= REFUSING_ALL_S
        )


def _drop(place: Place) -> None:
    place.live = False
    flow = place.flow
    flow.reserved -= place.cost
    if flow.reserved < 1e-12:  # none left (no float residue)
        flow.reserved = 0.0


def _lapse(flow: Flow, now: float) -> None:
    """Places whose time is up stop counting; dropped ones leave the queue (each place is
    appended once and removed once: O(1) amortised per call)."""
    places = flow.places
    while places and (not places[0].live or places[0].until <= now):
        place = places.popleft()
        if place.live:
            _drop(place)
    if not places:
        flow.reserved = 0.0


class AdmissionInterceptor(WrappingInterceptor):
    """The door of the scoring ``methods``, before their request is read.

    Each such call gets a stream-unary handler (gRPC starts those without receiving the request
    first) that learns the call's tenant from its metadata (``identify``), refuses at once with
    RESOURCE_EXHAUSTED when :meth:`Admission.door_full` for that tenant, and otherwise holds a
    place for it while it reads the one request, until the unary handler it wraps admits the
    request's real size. Other methods pass.
    """

    def __init__(
        self,
        admission: Admission,
        methods: Collection[str],
        identify: Identify = lambda metadata: tenants.DEFAULT,
    ) -> None:
        super().__init__()
        self.admission = admission
        self.methods = frozenset(methods)
        self.identify = identify

    def wraps(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        return method in self.methods and handler.unary_unary is not None

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        inner = handler.unary_unary
        admission, identify = self.admission, self.identify

        async def gate(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            tenant = identify(context.invocation_metadata())
            if admission.door_full(tenant):
                e = admission.door_refusal(tenant)
                await admission.pace(tenant)
                await context.abort(e.code, e.message)
            who = tenants.enter(tenant)  # this task serves the tenant's call to its end
            token = admission.enter(tenant)
            try:
                try:  # a timer, not a task: microseconds per call
                    async with asyncio.timeout(admission.read_timeout_s):
                        request = await context.read()
                except TimeoutError:
                    await context.abort(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"no request message within {admission.read_timeout_s:g} s of the "
                        "call's start (limits.read_timeout_s): send the request with the call",
                    )
                if request is grpc.aio.EOF:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
                return await inner(request, context)  # its admit() takes over the place
            finally:
                admission.leave(token)
                tenants.leave(who)

        return grpc.stream_unary_rpc_method_handler(
            gate, handler.request_deserializer, handler.response_serializer
        )
