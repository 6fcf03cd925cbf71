"""Where new calls go while a replica is paused and the other is slow (the chaos run's
pause-replica phase, docs/chaos.md): two stand-in TorchServes behind a real ``BackendPool``
(``tests/serving/test_hedge.py``'s ``two_replicas``)."""

from __future__ import annotations

import asyncio

from tests.serving.test_hedge import two_replicas


def test_new_calls_avoid_a_paused_replica_after_the_other_won_its_own_hedge() -> None:
    """b pauses: a call on it is hedged to a (b stalled; its copy hangs). a is then slow under
    the whole load: a call on it is hedged to b, the only other replica, and a's own copy wins.
    In the chaos run both then counted as stalled, b's hung copies did not count as in flight,
    and new calls went to the paused b half the time, waiting there 400-600 ms for a hedge the
    spent budget could not pay. New calls must go to a."""

    async def scenario() -> None:
        async with two_replicas() as (pool, stand_ins, request):
            a, b = pool.backends
            stand_ins[1].delay = 1.5  # b paused (its calls answer after the test is done)
            pool._next = 1  # round robin starts at b: the first call goes there
            _, target = await pool.predict(request, "1", None)
            assert target == a.target and b.stalled  # hedged to a; b's copy still hangs
            stand_ins[0].delay = 0.15  # a slow: past the hedge delay, but it answers
            _, target = await pool.predict(request, "1", None)
            assert target == a.target
            assert not a.stalled, "a answered before the replica its call was hedged to"
            assert b.in_flight >= 2, "the copies hung on b are calls in flight there"
            stand_ins[0].delay = 0.0
            picks = [b.target for b in (pool.pick(set(), "1") for _ in range(4)) if b is not None]
            assert picks == [a.target] * 4, f"new calls went to the paused replica: {picks}"
            await asyncio.sleep(1.6)  # b's copies end (answered) before the servers stop

    asyncio.run(scenario())
