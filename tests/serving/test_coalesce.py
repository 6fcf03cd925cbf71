"""Request coalescing: the merge arithmetic and scheduling in process (a fake backend that
records its calls), then 32 concurrent callers through the real gateway and TorchServe."""

from __future__ import annotations

import asyncio
import re
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

from serving.gateway.coalesce import Coalescer, Expired, split
from serving.gateway.config import CoalesceConfig
from serving.gateway.ranker import ASSUMED_WORKERS, call_slots
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request
from serving.torchserve.config import TorchServeConfig
from serving.worker.codec import SLICE_PARTS, Arrays, merge, to_rows
from tests.stack import start_gateway, stop_gateway, wait_status

F = 3  # sparse features in the in-process tests


def _batch(rng: np.random.Generator, b: int, first_id: int) -> Arrays:
    """``b`` examples with 0..2 ids per feature; ids numbered from ``first_id`` so every id
    says which request and position it came from."""
    lengths = rng.integers(0, 3, size=(F, b)).astype(np.int32)
    n = int(lengths.sum())
    values = np.arange(first_id, first_id + n, dtype=np.int64)
    dense = rng.normal(size=(b, 2)).astype(np.float32)
    return dense, values, lengths


def _by_example(arrays: Arrays) -> list[list[list[int]]]:
    """``[example][feature] -> ids``: the meaning of a feature-major encoding."""
    _, values, lengths = arrays
    out: list[list[list[int]]] = [[[] for _ in range(F)] for _ in range(lengths.shape[1])]
    pos = 0
    for f in range(F):
        for i in range(lengths.shape[1]):
            k = int(lengths[f, i])
            out[i][f] = values[pos : pos + k].tolist()
            pos += k
    return out


def test_merge_keeps_every_example_whole_and_in_order() -> None:
    rng = np.random.default_rng(0)
    parts = [_batch(rng, b, 1000 * k) for k, b in enumerate([3, 1, 5, 2])]
    merged = merge(parts)
    assert merged[0].shape == (11, 2) and merged[2].shape == (F, 11)
    expected = [ex for p in parts for ex in _by_example(p)]
    assert _by_example(merged) == expected
    np.testing.assert_array_equal(merged[0], np.concatenate([p[0] for p in parts]))
    many = [_batch(rng, b, 100 * k) for k, b in enumerate([1, 2, 1, 3] * 3)]  # sort path
    assert len(many) > SLICE_PARTS >= len(parts)  # and the slicing path above
    assert _by_example(merge(many)) == [ex for p in many for ex in _by_example(p)]
    assert [s.tolist() for s in split(np.arange(11.0), [3, 1, 5, 2])] == [
        [0, 1, 2], [3], [4, 5, 6, 7, 8], [9, 10],
    ]  # fmt: skip


class FakeBackend:
    """Scores = the first dense column; records each call's size; ``gate`` holds calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False

    async def send(self, arrays: Arrays, remaining: float | None) -> tuple[np.ndarray, str]:
        self.calls.append(arrays[0].shape[0])
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("backend down")
        return arrays[0][:, 0].copy(), "fake:1"


def _req(b: int, tag: float) -> Arrays:
    dense = np.full((b, 2), tag, dtype=np.float32)
    dense[:, 0] += np.arange(b, dtype=np.float32) / 1000
    return dense, np.empty(0, dtype=np.int64), np.zeros((F, b), dtype=np.int32)


def test_a_lone_request_goes_at_once_and_queued_ones_leave_as_one_call() -> None:
    async def scenario() -> None:
        fake = FakeBackend()
        co = Coalescer(fake.send, slots=1, max_examples=100)
        t0 = time.perf_counter()
        scores, backend = await co.score(_req(2, 1.0), None)
        assert time.perf_counter() - t0 < 0.05 and backend == "fake:1"  # no timer on idle
        np.testing.assert_allclose(scores, [1.0, 1.001])
        fake.gate.clear()
        first = asyncio.ensure_future(co.score(_req(1, 2.0), None))  # occupies the slot
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(co.score(_req(b, 10.0 + b), None)) for b in (3, 4, 5)]
        await asyncio.sleep(0.01)
        fake.gate.set()
        results = await asyncio.gather(first, *rest)
        assert fake.calls == [2, 1, 12]  # the three queued requests went as one call
        for (scores, _), b in zip(results[1:], (3, 4, 5), strict=True):
            np.testing.assert_allclose(scores, 10.0 + b + np.arange(b) / 1000, rtol=1e-6)
        assert co.stats.largest == 12 and co.in_flight == 0

    asyncio.run(scenario())


def test_the_next_batch_leaves_before_the_members_of_the_last_are_answered() -> None:
    """A backend worker waits for the gateway's next call while the gateway answers the
    members of the last one: the next call must be sent first (docs/architecture.md)."""

    async def scenario() -> None:
        events: list[str] = []
        gates = [asyncio.Event() for _ in range(3)]

        async def send(arrays: Arrays, remaining: float | None) -> tuple[np.ndarray, str]:
            n = len(events)
            events.append(f"send {arrays[0].shape[0]}")
            await gates[sum(e.startswith("send") for e in events[:n])].wait()
            return arrays[0][:, 0].copy(), "fake:1"

        co = Coalescer(send, slots=1, max_examples=100)

        async def caller(name: str, b: int) -> None:
            await co.score(_req(b, 1.0), None)
            events.append(f"answered {name}")

        tasks = [asyncio.ensure_future(caller("a", 1))]  # alone, holds the slot
        await asyncio.sleep(0.01)
        tasks += [asyncio.ensure_future(caller(n, 2)) for n in "bc"]  # queued
        await asyncio.sleep(0.01)
        gates[0].set()  # a answers; b and c leave as one call
        await asyncio.sleep(0.01)
        tasks += [asyncio.ensure_future(caller(n, 3)) for n in "de"]  # queued behind b + c
        await asyncio.sleep(0.01)
        gates[1].set()
        gates[2].set()
        await asyncio.gather(*tasks)
        assert events.index("send 6") < events.index("answered b"), events
        assert events.index("send 6") < events.index("answered c"), events

    asyncio.run(scenario())


def test_backend_calls_follow_the_workers_of_the_replicas_in_rotation() -> None:
    def replica(workers: int, healthy: bool = True) -> Any:
        return SimpleNamespace(workers=workers, healthy=healthy)

    per_worker = CoalesceConfig(calls_per_worker=2)
    assert call_slots(per_worker, [replica(2), replica(3)]) == 10
    assert call_slots(per_worker, [replica(0)]) == 2 * ASSUMED_WORKERS  # has not said
    assert call_slots(per_worker, [replica(2), replica(8, healthy=False)]) == 4
    assert call_slots(per_worker, [replica(2, False), replica(3, False)]) == 10  # none in rotation
    assert call_slots(CoalesceConfig(), [replica(16)]) == 16  # the default: one per worker
    fixed = CoalesceConfig(calls_per_backend=3)
    assert call_slots(fixed, [replica(2), replica(8, healthy=False)]) == 6
    with pytest.raises(ValueError, match="calls_per_worker"):
        CoalesceConfig(calls_per_worker=0)


def test_merged_calls_wait_on_deck_and_a_lone_request_never_does() -> None:
    """Beyond the slots, a call of two or more queued requests leaves at once (it waits in
    TorchServe's queue for the worker), up to ``deck`` of them; one queued request waits."""

    async def scenario() -> None:
        fake = FakeBackend()
        co = Coalescer(fake.send, slots=1, max_examples=100, deck=1)
        fake.gate.clear()
        first = asyncio.ensure_future(co.score(_req(1, 0.0), None))  # the slot
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(co.score(_req(2, 1.0), None))
        await asyncio.sleep(0.01)
        assert fake.calls == [1] and co.in_flight == 1  # one queued request waits
        third = asyncio.ensure_future(co.score(_req(3, 2.0), None))
        await asyncio.sleep(0.01)
        assert fake.calls == [1, 5] and co.in_flight == 2  # two: merged, on deck
        rest = [asyncio.ensure_future(co.score(_req(b, 3.0), None)) for b in (4, 5)]
        await asyncio.sleep(0.01)
        assert fake.calls == [1, 5] and co.in_flight == 2  # the deck is full
        fake.gate.set()
        results = await asyncio.gather(first, second, third, *rest)
        assert fake.calls == [1, 5, 9]
        assert [len(s) for s, _ in results] == [1, 2, 3, 4, 5]
        assert co.in_flight == 0

    asyncio.run(scenario())


def test_the_examples_cap_splits_the_queue_and_a_big_request_goes_alone() -> None:
    async def scenario() -> None:
        fake = FakeBackend()
        co = Coalescer(fake.send, slots=1, max_examples=10)
        fake.gate.clear()
        first = asyncio.ensure_future(co.score(_req(1, 0.0), None))
        await asyncio.sleep(0.01)
        sizes = [4, 4, 4, 30, 2]
        rest = [asyncio.ensure_future(co.score(_req(b, float(b)), None)) for b in sizes]
        await asyncio.sleep(0.01)
        fake.gate.set()
        results = await asyncio.gather(first, *rest)
        assert fake.calls == [1, 8, 4, 30, 2]
        assert all(len(s) == b for (s, _), b in zip(results[1:], sizes, strict=True))

    asyncio.run(scenario())


def test_a_large_request_neither_waits_for_a_slot_nor_merges() -> None:
    """``alone_examples``: a request that is a call's worth of work goes out at once while
    the slot is busy (small ones still queue and merge behind it)."""

    async def scenario() -> None:
        fake = FakeBackend()
        co = Coalescer(fake.send, slots=1, max_examples=100, alone_examples=20)
        fake.gate.clear()
        first = asyncio.ensure_future(co.score(_req(1, 0.0), None))  # occupies the slot
        await asyncio.sleep(0.01)
        small = [asyncio.ensure_future(co.score(_req(3, 1.0), None)) for _ in range(2)]
        large = [asyncio.ensure_future(co.score(_req(b, 2.0), None)) for b in (20, 30)]
        await asyncio.sleep(0.01)
        assert fake.calls == [1, 20, 30] and co.in_flight == 3  # sent while the slot is held
        fake.gate.set()
        results = await asyncio.gather(first, *small, *large)
        assert fake.calls == [1, 20, 30, 6]  # the small ones merged behind the slot
        assert [len(s) for s, _ in results] == [1, 3, 3, 20, 30] and co.in_flight == 0

    asyncio.run(scenario())


def test_an_expired_member_fails_alone_and_errors_reach_every_member() -> None:
    async def scenario() -> None:
        fake = FakeBackend()
        co = Coalescer(fake.send, slots=1, max_examples=100)
        fake.gate.clear()
        first = asyncio.ensure_future(co.score(_req(1, 0.0), None))
        await asyncio.sleep(0.01)
        short = asyncio.ensure_future(co.score(_req(2, 1.0), 0.005))
        long = asyncio.ensure_future(co.score(_req(3, 2.0), 5.0))
        await asyncio.sleep(0.05)  # the short deadline passes while queued
        fake.gate.set()
        await first
        with pytest.raises(Expired):
            await short
        assert len((await long)[0]) == 3 and fake.calls == [1, 3]
        fake.fail = True
        fake.gate.clear()
        a = asyncio.ensure_future(co.score(_req(1, 0.0), None))
        await asyncio.sleep(0.01)
        b, c = (asyncio.ensure_future(co.score(_req(1, 0.0), None)) for _ in range(2))
        fake.gate.set()
        for fut in (a, b, c):
            with pytest.raises(RuntimeError, match="backend down"):
                await fut
        assert co.in_flight == 0 and not co.queue

    asyncio.run(scenario())


@pytest.mark.slow
def test_32_concurrent_callers_get_their_own_scores(
    exported: tuple[Path, Path, str],
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    export, _, _ = exported
    cfg, _ = torchserve
    log = tmp_path / "gateway.log"
    cap = 600
    gateway, target = start_gateway(
        export / "schema.json", [cfg], log, deadline_s=10.0, log_level="DEBUG",
        coalesce=CoalesceConfig(max_examples=cap, calls_per_backend=1),
    )  # fmt: skip
    sample = np.load(export / "sample.npz")
    dense, probs = sample["dense"], sample["probs_int8"]
    sparse = to_rows(sample["values"], sample["lengths"])
    rng = np.random.default_rng(1)
    spans = [
        (lo, lo + int(b))
        for b in rng.integers(1, 501, 32)
        for lo in [int(rng.integers(0, 1000 - b))]
    ]
    results: dict[int, object] = {}
    try:
        wait_status(target, "SERVING", 120)
        with grpc.insecure_channel(target) as channel:
            stub = ranker_pb2_grpc.RankerStub(channel)
            start = threading.Barrier(34)

            def call(k: int, request: object, timeout: float) -> None:
                start.wait()
                try:
                    results[k] = stub.Score(request, timeout=timeout)
                except grpc.RpcError as e:
                    results[k] = e.code()  # type: ignore[attr-defined]

            bad = build_request(dense[:3], sparse[:3])
            bad.dense[4] = float("nan")
            threads = [
                threading.Thread(
                    target=call, args=(k, build_request(dense[lo:hi], sparse[lo:hi]), 30.0)
                )
                for k, (lo, hi) in enumerate(spans)
            ]
            threads.append(threading.Thread(target=call, args=(32, bad, 30.0)))
            threads.append(
                threading.Thread(
                    target=call, args=(33, build_request(dense[:5], sparse[:5]), 0.001)
                )
            )
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
    finally:
        assert stop_gateway(gateway) == 0
    for k, (lo, hi) in enumerate(spans):
        reply = results[k]
        assert not isinstance(reply, grpc.StatusCode), f"caller {k}: {reply}"
        np.testing.assert_allclose(np.asarray(reply.scores), probs[lo:hi], atol=1e-6)  # type: ignore[attr-defined]
    assert results[32] == grpc.StatusCode.INVALID_ARGUMENT
    assert results[33] == grpc.StatusCode.DEADLINE_EXCEEDED
    calls = [
        (int(r), int(e))
        for r, e in re.findall(r"backend call: (\d+) requests, (\d+) examples", log.read_text())
    ]
    scored = [(r, e) for r, e in calls if e > 1]  # the health probe sends 1-example calls
    assert scored and max(e for _, e in calls) <= max(cap, max(hi - lo for lo, hi in spans))
    assert all(e <= cap or r == 1 for r, e in calls)  # above the cap only a request alone
    assert any(r > 1 for r, _ in scored), f"nothing was merged: {calls}"
