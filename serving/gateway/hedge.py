"""Hedged backend calls: the tail at scale, within a budget.

Scoring has no side effects, so a call that its replica has not answered by the backends'
recent tail (``hedge.factor`` x the ``hedge.quantile`` of the last :data:`WINDOW` answered
calls, at least ``hedge.min_ms``) can be sent to another replica in rotation as well; the first answer wins and
the other copy runs out uncancelled (``BackendPool._orphan``). A replica that stalls (a paused process, a long GC, a saturated
host) then costs its callers about the tail latency instead of the backend deadline. Every call
earns ``hedge.ratio`` of a hedge and a hedge spends one, so hedges stay a few percent of calls
however slow the backends get: overload is never doubled. No hedge before :data:`WARM` calls
have been seen (no tail to speak of).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from serving.gateway.config import HedgeConfig

WINDOW = 512  # answered calls the tail is measured over
WARM = 20  # answered calls before the first hedge
BURST = 10.0  # most hedges saved up in a quiet spell


class Hedger:
    """When to hedge a call, and the budget of hedges (one per gateway process)."""

    def __init__(self, cfg: HedgeConfig) -> None:
        self.cfg = cfg
        self.recent: deque[float] = deque(maxlen=WINDOW)
        self.tokens = 1.0
        self._tail: float | None = None
        self._stale = 0

    def observe(self, seconds: float) -> None:
        """An answered backend call took ``seconds``."""
        self.recent.append(seconds)
        self._stale += 1

    def earn(self) -> None:
        """A backend call starts: it earns ``ratio`` of a hedge."""
        self.tokens = min(BURST, self.tokens + self.cfg.ratio)

    def delay(self) -> float | None:
        """Seconds to wait for an answer before hedging; None = do not hedge."""
        if self.cfg.ratio <= 0 or len(self.recent) < WARM:
            return None
        if self._tail is None or self._stale >= 16:  # sorted every 16 answers, not every call
            ordered = sorted(self.recent)
            self._tail = ordered[int(self.cfg.quantile * (len(ordered) - 1))]
            self._stale = 0
        return max(self.cfg.factor * self._tail, self.cfg.min_ms / 1e3)

    def spend(self) -> bool:
        """Take one hedge from the budget; False when it is spent."""
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


async def answered_within(call: Any, seconds: float) -> bool:
    """Wait until grpc ``call`` is done or ``seconds`` have passed; True if it is done. The
    call is cancelled if the waiter is."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(*_: Any) -> None:
        if not waiter.done():
            waiter.set_result(None)

    call.add_done_callback(wake)
    timer = loop.call_later(seconds, wake)
    try:
        await waiter
    except asyncio.CancelledError:
        call.cancel()
        raise
    finally:
        timer.cancel()
    return bool(call.done())
