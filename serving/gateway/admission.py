"""Overload control at the gateway's door: refuse fast what cannot be served in time.

Two rules, checked before a request joins the coalescer's queue:

- **Budgets of work in flight**: examples (``limits.max_inflight_examples``) and ids
  (``limits.max_inflight_ids``: a 1,000-example request with 64 ids per feature is ~60x the
  work of one with 1 id, which a count of examples cannot see). Beyond either a request is
  refused at once with RESOURCE_EXHAUSTED instead of queueing behind work that already fills
  the backends (a queue only turns overload into timeouts for everyone, health probes
  included). With nothing in flight any request within the per-request limits is admitted.
- **A deadline that cannot be met**: while other requests are in flight, a request whose
  remaining deadline is shorter than the backends' recent call latency is refused at once with
  DEADLINE_EXCEEDED, instead of using a slot for an answer that would arrive too late. The
  estimate cannot wedge the gate: it is an exponentially weighted average of every backend call,
  failures and timeouts included (their elapsed time); it decays with time since the last call
  (half-life :data:`LATENCY_HALF_LIFE_S`), so one slow call is forgotten within seconds even if
  nothing succeeds; and with nothing in flight a request always goes through, so an idle gateway
  measures the backends again instead of trusting an old figure. :meth:`Admission.refusing_all`
  tells health when the gate has refused every call for a while anyway.

Both refusals cost microseconds and leave what is already in flight untouched.
:class:`AdmissionInterceptor` applies the budget before a scoring call's request is even read:
calls past that door and not yet admitted (receiving, decoding) count as the largest request
admitted in the last :data:`PEAK_WINDOW_S` (halving every window after that without a new
admission), and a call that would not fit with them is refused before its upload (a refused
megabyte request costs its caller and the gateway no upload). Without that, a burst of large
requests all passes the door while nothing is admitted yet, uploads, and is refused only after,
each refusal as slow as an upload. Before the first request is admitted nothing is known of
sizes: calls count as the per-request limit, and one that does not fit waits, unread, for the
first admission (at most :attr:`Admission.hold_s`) instead of being refused.

Every place at the door has a deadline, so that idle clients cannot hold capacity others need
(one client's 16 streams that sent headers and never a message once refused every real call):
a place counts for :attr:`Admission.hold_s` (the time a request should take to arrive) and then
lapses; all places together count for at most :data:`RESERVED_SHARE` of the budget (the rest
stays open to calls past the door: a burst at a quiet gateway beyond that share is refused by
the in-flight budget after its upload instead of before); and a call whose request has not
arrived within :attr:`Admission.read_timeout_s` ends DEADLINE_EXCEEDED, freeing its stream.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import grpc

from serving.gateway import metrics
from serving.gateway.errors import ScoreError
from serving.gateway.rpc import WrappingInterceptor
from serving.gateway.validate import Limits

# weight of the newest backend call in the latency average: ~the last 10 calls matter
EWMA_WEIGHT = 0.1
# a call at the door counts as the largest request admitted in this window (seconds): the
# average let a burst of large requests in after small ones (64 x 1,000 examples after calls
# of 10 all uploaded, and 1 in 10 of them was refused only after, in up to 1.3 s)
PEAK_WINDOW_S = 10.0
# the latency estimate halves every this many seconds without a backend call to refresh it
LATENCY_HALF_LIFE_S = 2.0
# health says NOT_SERVING when the deadline gate refused every call for this long (and at least
# REFUSING_ALL_MIN calls): a gateway that only refuses should be taken out of rotation
REFUSING_ALL_S = 5.0
REFUSING_ALL_MIN = 20
# how often a call waiting at the door before the first admission looks again
DOOR_POLL_S = 0.002
# how long a place at the door counts (seconds), and how long a call may take to send its
# request: the gateway's limits say (these are their defaults)
DOOR_HOLD_S = Limits.door_hold_s
READ_TIMEOUT_S = Limits.read_timeout_s
# the places at the door count for at most this share of the budget (of examples, of ids): the
# rest is always open to calls past the door, whatever idle streams hold
RESERVED_SHARE = 0.5


class Place:
    """A call's place at the door: what it is expected to bring, until when that counts, and
    whether it still does (admitted, ended or lapsed: no)."""

    __slots__ = ("examples", "ids", "live", "until")

    def __init__(self, examples: float, ids: float, until: float) -> None:
        self.examples, self.ids, self.until, self.live = examples, ids, until, True


# the place a call holds at the door, per task: admit() converts it into the call's real size
_DOOR: contextvars.ContextVar[Place | None] = contextvars.ContextVar("admission_door", default=None)


def aged(peak: int, at: float, now: float) -> float:
    """``peak`` (admitted at ``at``) as the door counts it at ``now``: whole for
    :data:`PEAK_WINDOW_S`, then halving every window (a peak no admission renews fades)."""
    age = now - at
    if age <= PEAK_WINDOW_S:
        return float(peak)
    return peak * 0.5 ** ((age - PEAK_WINDOW_S) / PEAK_WINDOW_S)


@dataclass
class Admission:
    """Examples in flight and the backends' recent latency (one per gateway process)."""

    max_examples: int
    """Most examples admitted at once (requests being validated, queued or scored)."""
    max_ids: int | None = None
    """Most sparse ids admitted at once (None: no budget of ids)."""
    in_flight: int = 0
    ids_in_flight: int = 0
    latency_s: float = 0.0
    """Backend call latency, seconds, as of :attr:`latency_at` (0 until the first call); read
    it through :meth:`latency` (decayed to now)."""
    latency_at: float = 0.0
    deadline_refusals: int = 0
    """Consecutive deadline refusals since the last admission."""
    last_admit_at: float = 0.0
    refused: int = 0
    reserved: float = 0.0
    """Examples expected from the calls past the door not admitted yet (receiving or decoding
    their request) whose place has not lapsed: each counts as :attr:`expected` did when it
    entered."""
    reserving: int = 0
    """Calls holding those places."""
    prior_examples: float = 0.0
    """What a call at the door counts as before any request was admitted (the gateway: its
    per-request limit, the worst case)."""
    reserved_ids: float = 0.0
    """Ids expected from the calls past the door not admitted yet (each: :attr:`peak_ids`)."""
    peak_ids: int = 0
    """The most ids of a request admitted in the last :data:`PEAK_WINDOW_S` (about)."""
    peak_ids_at: float = 0.0
    peak_examples: int = 0
    """The largest request admitted in the last :data:`PEAK_WINDOW_S` (about)."""
    peak_at: float = 0.0
    hold_s: float = DOOR_HOLD_S
    """How long a place at the door counts: the time a request should take to arrive."""
    read_timeout_s: float = READ_TIMEOUT_S
    """How long a call past the door may take to send its request (then DEADLINE_EXCEEDED)."""
    places: deque[Place] = field(default_factory=deque, repr=False)
    """Places in entry order (so in order of lapsing); admitted ones are dropped lazily."""

    def admit(self, examples: int, time_remaining: float | None, ids: int = 0) -> None:
        """Reserve ``examples`` and ``ids`` or raise :class:`ScoreError` (the caller must
        :meth:`release` exactly what was admitted)."""
        self.check(examples, time_remaining)
        if self.max_ids is not None and self.in_flight and self.ids_in_flight + ids > self.max_ids:
            raise self.refusal(
                message=f"overloaded: {self.ids_in_flight} ids in flight, the limit is "
                f"{self.max_ids}; retry with backoff"
            )
        self.in_flight += examples
        self.ids_in_flight += ids
        place = _DOOR.get()
        if place is not None:  # this call's place at the door becomes its real size
            if place.live:
                self._drop(place)
            _DOOR.set(None)
        now = time.monotonic()
        self.deadline_refusals, self.last_admit_at = 0, now
        if examples >= self.peak_examples or now - self.peak_at > PEAK_WINDOW_S:
            self.peak_examples, self.peak_at = examples, now
        if ids >= self.peak_ids or now - self.peak_ids_at > PEAK_WINDOW_S:
            self.peak_ids, self.peak_ids_at = ids, now

    def check(self, examples: int, time_remaining: float | None) -> None:
        """Raise :class:`ScoreError` when :meth:`admit` would refuse (reserves nothing): lets
        a request be refused before the work of decoding it."""
        if self.in_flight and self.in_flight + examples > self.max_examples:
            raise self.refusal()
        # with nothing in flight the call goes through whatever the estimate says: it is the
        # probe that corrects an estimate no longer true (the gate never refuses on its own say)
        if time_remaining is not None and self.in_flight:
            latency = self.latency()
            if time_remaining < latency:
                self.deadline_refusals += 1
                raise self.refusal(
                    "deadline",
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the remaining deadline ({time_remaining * 1e3:.1f} ms) is shorter than "
                    f"the backends' recent latency ({latency * 1e3:.1f} ms)",
                )

    def refusal(
        self,
        reason: str = "overload",
        code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED,
        message: str = "",
    ) -> ScoreError:
        """A refusal, counted (here and in the rejections metric by ``reason``); the default
        is the overload one."""
        self.refused += 1
        metrics.rejected(reason)
        return ScoreError(
            code,
            message
            or f"overloaded: {self.in_flight} examples in flight, the limit is "
            f"{self.max_examples}; retry with backoff",
        )

    def door_full(self, now: float | None = None) -> bool:
        """No room for one more call: what is admitted, plus what the calls past the door are
        expected to bring (places not lapsed, at most :data:`RESERVED_SHARE` of the budget),
        plus this one, is over the budget."""
        now = time.monotonic() if now is None else now
        self._lapse(now)
        busy = self.in_flight + min(self.reserved, RESERVED_SHARE * self.max_examples)
        if busy > 0 and busy + self.expected_at(now) > self.max_examples:
            return True
        if self.max_ids is None:
            return False
        # ids: counted once sizes are known
        busy_ids = self.ids_in_flight + min(self.reserved_ids, RESERVED_SHARE * self.max_ids)
        return busy_ids > 0 and busy_ids + aged(self.peak_ids, self.peak_ids_at, now) > self.max_ids

    def door_refusal(self) -> ScoreError:
        """The door's refusal (counted): what is in flight and what the places hold."""
        counted = min(self.reserved, RESERVED_SHARE * self.max_examples)
        return self.refusal(
            message=f"overloaded: {self.in_flight:,} examples in flight + {counted:,.0f} "
            f"reserved by {self.reserving} calls still receiving their request; the limit is "
            f"{self.max_examples:,}; retry with backoff"
        )

    @property
    def expected(self) -> float:
        """Examples a call at the door counts as (:meth:`expected_at` now)."""
        return self.expected_at(time.monotonic())

    def expected_at(self, now: float) -> float:
        """The largest request of the last :data:`PEAK_WINDOW_S`, fading after it
        (:func:`aged`); the worst case, ``prior_examples``, before the first admission."""
        if not self.sizes_known:
            return self.prior_examples
        return aged(self.peak_examples, self.peak_at, now)

    @property
    def sizes_known(self) -> bool:
        """A request was admitted (every admitted request has at least one example)."""
        return self.peak_examples > 0

    def enter(self) -> contextvars.Token[Place | None]:
        """A call passes the door: hold :attr:`expected` examples and the recent peak of ids
        for it, for :attr:`hold_s` at most, until :meth:`admit` (in the same task) or
        :meth:`leave`."""
        now = time.monotonic()
        place = Place(
            self.expected_at(now), aged(self.peak_ids, self.peak_ids_at, now), now + self.hold_s
        )
        self.reserved += place.examples
        self.reserved_ids += place.ids
        self.reserving += 1
        self.places.append(place)
        return _DOOR.set(place)

    def leave(self, token: contextvars.Token[Place | None]) -> None:
        """The call is done: drop its place at the door if :meth:`admit` did not take it."""
        place = _DOOR.get()
        if place is not None and place.live:
            self._drop(place)
        _DOOR.reset(token)

    def _drop(self, place: Place) -> None:
        place.live = False
        self.reserving -= 1
        if self.reserving:
            self.reserved -= place.examples
            self.reserved_ids -= place.ids
        else:  # none left: exactly nothing (no float residue)
            self.reserved = self.reserved_ids = 0.0

    def _lapse(self, now: float) -> None:
        """Places whose time is up stop counting; dropped ones leave the queue (each place is
        appended once and removed once: O(1) amortised per call)."""
        places = self.places
        while places and (not places[0].live or places[0].until <= now):
            place = places.popleft()
            if place.live:
                self._drop(place)

    def release(self, examples: int, ids: int = 0) -> None:
        self.in_flight -= examples
        self.ids_in_flight -= ids

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


class AdmissionInterceptor(WrappingInterceptor):
    """The budget at the door of the scoring ``methods``, before their request is read.

    Each such call gets a stream-unary handler (gRPC starts those without receiving the request
    first) that refuses at once with RESOURCE_EXHAUSTED when :meth:`Admission.door_full`, and
    otherwise holds a place for it (:attr:`Admission.expected`) while it reads and decodes
    the one request, until the unary handler it wraps admits the request's real size. Other
    methods pass.
    """

    def __init__(self, admission: Admission, methods: Collection[str]) -> None:
        super().__init__()
        self.admission = admission
        self.methods = frozenset(methods)

    def wraps(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        return method in self.methods and handler.unary_unary is not None

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        inner = handler.unary_unary
        admission = self.admission

        async def gate(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            if admission.door_full():
                await wait_at_door(admission, context)
            token = admission.enter()
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

        return grpc.stream_unary_rpc_method_handler(
            gate, handler.request_deserializer, handler.response_serializer
        )


async def wait_at_door(admission: Admission, context: grpc.aio.ServicerContext) -> None:
    """A call the door has no room for: refused at once once sizes are known. Before the first
    admission the door counts every call at the worst case (``prior_examples``): a call that
    does not fit waits, unread, for the first real size or for places to lapse, at most
    :attr:`Admission.hold_s` (a burst of small calls at start is not refused for fear of large
    ones; a burst of large ones is refused once the first is admitted)."""
    give_up = time.monotonic() + admission.hold_s
    while not admission.sizes_known:
        await asyncio.sleep(DOOR_POLL_S)
        now = time.monotonic()
        if not admission.door_full(now):
            return
        if now >= give_up:
            break
    e = admission.door_refusal()
    await context.abort(e.code, e.message)
