"""Overload control at the gateway's door: refuse fast what cannot be served in time.

Two rules, checked before a request joins the coalescer's queue:

- **A budget of examples in flight** (``limits.max_inflight_examples``): beyond it a request is
  refused at once with RESOURCE_EXHAUSTED instead of queueing behind work that already fills the
  backends (a queue only turns overload into timeouts for everyone, health probes included).
- **A deadline that cannot be met**: a request whose remaining deadline is shorter than the
  backends' recent call latency (an exponentially weighted average of the calls that succeeded)
  is refused at once with DEADLINE_EXCEEDED, instead of using a slot for an answer that would
  arrive too late.

Both refusals cost microseconds and leave what is already in flight untouched. While the budget
has no room left for a request of the largest size, :class:`AdmissionInterceptor` refuses
scoring calls before their request is even read (a refused megabyte request costs its caller
and the gateway no upload), so refusals stay fast however large the requests are.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import grpc

from serving import metrics
from serving.errors import ScoreError

# weight of the newest backend call in the latency average: ~the last 10 calls matter
EWMA_WEIGHT = 0.1


@dataclass
class Admission:
    """Examples in flight and the backends' recent latency (one per gateway process)."""

    max_examples: int
    """Most examples admitted at once (requests being validated, queued or scored)."""
    in_flight: int = 0
    latency_s: float = 0.0
    """Recent backend call latency, seconds (0 until the first call)."""
    refused: int = 0

    def admit(self, examples: int, time_remaining: float | None) -> None:
        """Reserve ``examples`` or raise :class:`ScoreError` (the caller must :meth:`release`
        exactly what was admitted)."""
        self.check(examples, time_remaining)
        self.in_flight += examples

    def check(self, examples: int, time_remaining: float | None) -> None:
        """Raise :class:`ScoreError` when :meth:`admit` would refuse (reserves nothing): lets
        a request be refused before the work of decoding it."""
        if self.in_flight and self.in_flight + examples > self.max_examples:
            raise self.refusal()
        if time_remaining is not None and time_remaining < self.latency_s:
            raise self.refusal(
                "deadline",
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the remaining deadline ({time_remaining * 1e3:.1f} ms) is shorter than the "
                f"backends' recent latency ({self.latency_s * 1e3:.1f} ms)",
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

    def full(self, largest: int) -> bool:
        """No room left for a request of ``largest`` examples."""
        return self.in_flight > 0 and self.in_flight + largest > self.max_examples

    def release(self, examples: int) -> None:
        self.in_flight -= examples

    def observe(self, seconds: float) -> None:
        """A backend call that succeeded took ``seconds``."""
        if self.latency_s == 0.0:
            self.latency_s = seconds
        else:
            self.latency_s += EWMA_WEIGHT * (seconds - self.latency_s)


class AdmissionInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses the scoring ``methods`` with RESOURCE_EXHAUSTED while ``admission`` has no room
    for a request of ``largest`` examples, before the request is read: the refusal is a
    stream-unary handler, which gRPC starts without receiving the request first."""

    def __init__(self, admission: Admission, methods: Collection[str], largest: int) -> None:
        self.admission = admission
        self.methods = frozenset(methods)
        self.largest = largest

        async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> None:
            e = self.admission.refusal()
            await context.abort(e.code, e.message)

        self._refuse = grpc.stream_unary_rpc_method_handler(refuse)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method in self.methods and self.admission.full(self.largest):
            return self._refuse
        return await continuation(details)
