"""The hedging rule (``serving.gateway.hedge.Hedger``) as pure arithmetic; a paused replica under
load through the real gateway is in tests/serving/test_failover.py."""

from __future__ import annotations

import pytest

from serving.gateway.config import HedgeConfig
from serving.gateway.hedge import WARM, Hedger


def test_no_hedge_before_there_is_a_tail_nor_when_off() -> None:
    h = Hedger(HedgeConfig())
    for _ in range(WARM - 1):
        h.observe(0.01)
    assert h.delay() is None
    h.observe(0.01)
    assert h.delay() == pytest.approx(0.02)  # twice the p95 of 10 ms answers
    off = Hedger(HedgeConfig(ratio=0.0))
    for _ in range(100):
        off.observe(0.01)
    assert off.delay() is None


def test_the_delay_is_twice_the_tail_and_at_least_min_ms() -> None:
    h = Hedger(HedgeConfig(min_ms=5))
    for i in range(100):  # 1..100 ms
        h.observe((i + 1) / 1e3)
    assert h.delay() == pytest.approx(2 * 0.095, abs=2e-3)
    fast = Hedger(HedgeConfig(min_ms=20))
    for _ in range(100):
        fast.observe(0.001)
    assert fast.delay() == pytest.approx(0.020)


def test_hedges_stay_within_the_budget_however_slow_the_backends() -> None:
    """Every call wants a hedge (a backend that stalls all of them): at most ``ratio`` of the
    calls get one, plus what a quiet spell saved (one to start)."""
    h = Hedger(HedgeConfig(ratio=0.05))
    hedges = 0
    for _ in range(10_000):
        h.earn()
        hedges += h.spend()
    assert hedges <= 1 + 0.05 * 10_000
    assert hedges >= 0.05 * 10_000 - 1
