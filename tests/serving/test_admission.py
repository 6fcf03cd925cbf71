"""The admission door's arithmetic (``serving.gateway.admission.Admission``), as pure functions.

The door runs in the real gateway in tests/serving/test_overload.py (64 callers of the largest
request) and test_coalesce.py (34 simultaneous callers at a cold gateway, none refused)."""

from __future__ import annotations

import grpc
import pytest

from serving.gateway import admission as adm
from serving.gateway.admission import Admission
from serving.gateway.errors import ScoreError


def test_before_any_request_a_call_at_the_door_counts_as_the_largest_allowed() -> None:
    a = Admission(3500, prior_examples=1000)
    tokens = [a.enter() for _ in range(3)]  # three calls reading their request
    assert a.reserved == 3000
    assert a.door_full()  # a fourth would make 3,000 + 1,000 expected > 3,500
    assert not a.sizes_known  # ... but sizes are unknown: the gate waits instead of refusing
    for t in reversed(tokens):  # one context here; in the gateway each call is a task
        a.leave(t)
    assert a.reserved == 0 and not a.door_full()


def test_admit_converts_the_place_at_the_door_into_the_real_size() -> None:
    a = Admission(4000, prior_examples=1000)
    token = a.enter()
    a.admit(10, None)
    assert (a.in_flight, a.reserved) == (10, 0)
    a.leave(token)  # the call ends: its place was already taken over
    assert a.reserved == 0
    a.release(10)
    assert a.in_flight == 0


def test_the_door_counts_calls_at_the_largest_recent_size_not_the_average() -> None:
    a = Admission(3500, prior_examples=1000)
    for examples in (1000, *[10] * 50):  # one large request, then many small ones
        token = a.enter()
        a.admit(examples, None)
        a.release(examples)
        a.leave(token)
    assert a.expected == 1000  # the average (~15, what the door used to count) is not it
    tokens = [a.enter() for _ in range(3)]
    assert a.door_full()  # 3 x 1,000 unread + 1,000 > 3,500: a fourth is refused unread
    for t in reversed(tokens):  # one context here; in the gateway each call is a task
        a.leave(t)


def test_the_peak_ages_out(monkeypatch: pytest.MonkeyPatch) -> None:
    a = Admission(4000, prior_examples=1000)
    now = [100.0]
    monkeypatch.setattr(adm.time, "monotonic", lambda: now[0])
    a.admit(1000, None)
    a.release(1000)
    now[0] += adm.PEAK_WINDOW_S + 1
    a.admit(5, None)
    assert a.expected == 5


def test_refusals_name_the_budget_and_the_deadline() -> None:
    a = Admission(100, prior_examples=100)
    a.admit(80, None)
    with pytest.raises(ScoreError) as e:
        a.admit(30, None)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 100" in e.value.message
    a.observe(0.5)
    with pytest.raises(ScoreError) as e:
        a.check(1, 0.1)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert a.refused == 2 and a.in_flight == 80


def test_a_slow_first_call_does_not_wedge_the_deadline_gate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 24: one 0.4 s call set the estimate, only successes updated it, and every later
    call (deadline 0.2 s) was refused forever: 10,000 of 10,000. Now the estimate decays and an
    idle gate lets calls through, so fast backends are seen again within seconds."""
    a = Admission(10_000, prior_examples=1)
    now = [100.0]
    monkeypatch.setattr(adm.time, "monotonic", lambda: now[0])
    a.observe(0.4)  # the slow first call
    a.admit(1, 0.2)  # nothing in flight: goes through despite the estimate (it is the probe)
    refused = served = 0
    for _ in range(5000):  # steady load: one call always in flight, 1 ms apart, backends 5 ms
        now[0] += 0.001
        try:
            a.admit(1, 0.2)
        except ScoreError as e:
            assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED
            refused += 1
            continue
        served += 1
        a.observe(0.005)
        a.release(1)
    # refused for ~2 s (0.4 s halves below the 0.2 s deadline in one half-life), then served
    assert refused <= 2000 * adm.LATENCY_HALF_LIFE_S / 2 + 10, (served, refused)
    assert served >= 5000 - refused
    assert a.latency() < 0.05


def test_failures_and_timeouts_teach_the_estimate() -> None:
    a = Admission(100)
    a.observe(0.005)
    for _ in range(30):  # a stalled backend: every call times out after 2 s
        a.observe(2.0)
    assert a.latency() > 1.0  # the gate knows calls now take seconds


def test_the_estimate_decays_without_news(monkeypatch: pytest.MonkeyPatch) -> None:
    a = Admission(100)
    now = [0.0]
    monkeypatch.setattr(adm.time, "monotonic", lambda: now[0])
    a.observe(2.0)
    now[0] += adm.LATENCY_HALF_LIFE_S * 3
    assert a.latency() == pytest.approx(0.25)


def test_health_hears_of_a_gate_that_refuses_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    a = Admission(100)
    now = [0.0]
    monkeypatch.setattr(adm.time, "monotonic", lambda: now[0])
    a.admit(1, None)  # one call in flight (never ends)
    for _ in range(10_000):  # a backend really slower than every caller's deadline
        a.observe(1.0)
    for _ in range(adm.REFUSING_ALL_MIN):
        now[0] += adm.REFUSING_ALL_S / adm.REFUSING_ALL_MIN
        with pytest.raises(ScoreError):
            a.admit(1, 0.01)
        a.observe(1.0)
    assert a.refusing_all()
    a.release(1)
    a.admit(1, 0.01)  # idle: a call goes through, and health may say SERVING again
    assert not a.refusing_all()


def test_the_budget_counts_ids_not_only_examples() -> None:
    """Issue 20: a 1,000-example request with 64 ids per feature is ~60x the work of one with
    1 id; a budget of examples alone admitted two at once where the ids say one is enough."""
    a = Admission(16384, 1 << 20, prior_examples=1000)
    heavy = 1000 * 26 * 64  # 1.66M ids: over the budget, admitted alone (nothing in flight)
    a.admit(1000, None, heavy)
    with pytest.raises(ScoreError) as e:  # 2,000 examples of 16,384: examples alone admit it
        a.admit(1000, None, heavy)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{heavy} ids in flight, the limit is {1 << 20}" in e.value.message
    assert a.in_flight == 1000 and a.ids_in_flight == heavy  # the refusal reserved nothing
    light = 1000 * 26  # the same examples with 1 id per feature fit beside it... once released
    a.release(1000, heavy)
    for _ in range(16):
        a.admit(1000, None, light)  # 16,000 examples, 416k ids: both budgets hold
    assert a.ids_in_flight == 16 * light
