"""Two TorchServe replicas behind one gateway: stop one under load, then bring it back.

Every call, the stop and the restart window included, must succeed with the export's own
scores (the stopped replica answers the calls it holds before it exits); the traffic must move
to the survivor and come back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request
from serving.torchserve import process
from serving.torchserve.client import inference_key, score
from serving.worker.codec import encode_request, to_rows
from tests.stack import (
    ours,
    start_gateway,
    start_torchserve,
    stop_gateway,
    torchserve_config,
    wait_status,
)

pytestmark = pytest.mark.slow
DEADLINE_S = 1.0
ROWS = 8


class Load:
    """Threads calling Score in a loop, recording (start, outcome, backend) of every call.

    A reply whose scores differ from ``expected`` is recorded as ``BAD_SCORES``."""

    def __init__(
        self,
        stub: ranker_pb2_grpc.RankerStub,
        request: object,
        expected: np.ndarray,
        threads: int = 3,
    ) -> None:
        self.stub, self.request, self.expected = stub, request, expected
        self.records: list[tuple[float, str, str]] = []
        self.seconds: list[tuple[float, float]] = []  # (start, duration) of every call
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                reply, call = self.stub.Score.with_call(self.request, timeout=10)
                backend = dict(call.trailing_metadata()).get("x-recsys-backend", "?")
                scores = np.asarray(reply.scores)
                good = scores.shape == self.expected.shape and np.allclose(
                    scores, self.expected, atol=1e-6, rtol=0
                )
                self.records.append((t, "OK" if good else "BAD_SCORES", backend))
            except grpc.RpcError as e:
                self.records.append((t, e.code().name, ""))
            self.seconds.append((t, time.monotonic() - t))
            time.sleep(0.01)

    def window(self, start: float, end: float = float("inf")) -> tuple[Counter[str], Counter[str]]:
        """Outcomes of the calls started in ``[start, end)``, and the backends of the OK ones."""
        rows = [r for r in self.records if start <= r[0] < end]
        return Counter(r[1] for r in rows), Counter(r[2] for r in rows if r[1] == "OK")

    def wait(self, what: str, ok: Callable[[Counter[str]], bool], timeout: float = 30) -> float:
        """Wait until the OK calls of the last second (started after this call) satisfy
        ``ok``; the time it held."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            now = time.monotonic()
            if ok(self.window(max(t0, now - 1), now)[1]):
                return now
            time.sleep(0.1)
        raise AssertionError(f"{what}: not seen within {timeout} s: {self.window(t0)}")


@dataclass
class Replicas:
    """Two replicas of the tiny model behind one gateway, under :class:`Load`."""

    cfgs: dict[str, Any]
    procs: dict[str, subprocess.Popen[bytes]]
    load: Load
    ta: str
    tb: str
    sample: bytes
    """The export's whole sample (1,000 rows) as one TorchServe request body."""
    t_both: float = 0.0
    """When both replicas were seen answering."""


@contextlib.contextmanager
def two_replicas_under_load(exported: tuple[Path, Path, str], tmp_path: Path) -> Iterator[Replicas]:
    """Replicas a and b behind one gateway (deadline DEADLINE_S), the load running on the
    sample's first ROWS rows once both answer; after the block the load, the gateway and both
    replicas (resumed if paused) are stopped."""
    export, store, _ = exported
    cfgs = {k: torchserve_config(store, tmp_path / k) for k in ("a", "b")}
    procs = {k: start_torchserve(c) for k, c in cfgs.items()}
    gateway, target = start_gateway(
        export / "schema.json", list(cfgs.values()), tmp_path / "gateway.log",
        deadline_s=DEADLINE_S,
    )  # fmt: skip
    s = np.load(export / "sample.npz")
    request = build_request(s["dense"][:ROWS], to_rows(s["values"], s["lengths"])[:ROWS])
    ta, tb = cfgs["a"].grpc_inference_target, cfgs["b"].grpc_inference_target
    with grpc.insecure_channel(target) as channel:
        load = Load(ranker_pb2_grpc.RankerStub(channel), request, s["probs_int8"][:ROWS])
        r = Replicas(
            cfgs, procs, load, ta, tb, encode_request(s["dense"], s["values"], s["lengths"])
        )
        try:
            wait_status(target, "SERVING", 60)
            for t in load.threads:
                t.start()
            r.t_both = load.wait("both replicas answering", lambda c: bool(c[ta] and c[tb]))
            yield r
        finally:
            load.stop.set()
            for t in load.threads:
                if t.is_alive():
                    t.join()
            stop_gateway(gateway)
            for p in procs.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGCONT)
                process.stop(p)


def test_a_paused_then_a_stopped_replica_fail_no_call(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """One pair of replicas under load, two faults in turn (one stack: its start is most of
    the cost): a pause that must cost a hedge, not a deadline, then a stop and a restart that
    must fail nothing."""
    with two_replicas_under_load(exported, tmp_path) as r:
        paused_a_replica_costs_its_callers_a_hedge_not_a_deadline(r, tmp_path)
        stopping_a_replica_fails_nothing(r)
    assert not ours(tmp_path)


def paused_a_replica_costs_its_callers_a_hedge_not_a_deadline(r: Replicas, log_dir: Path) -> None:
    """SIGSTOP one replica (java and its workers) under load: the calls it holds are hedged to
    the other after the recent tail, so none fails and none waits for the deadline; after
    SIGCONT it serves again (issue 20, hedged calls)."""
    load, procs, ta, tb = r.load, r.procs, r.ta, r.tb
    # answered calls: the tail the hedges wait for, and the budget they spend (every call
    # earns 0.05 of a hedge, one to start: the 3 callers' calls stuck on the paused
    # replica need 3). A fixed sleep gave too few calls on a loaded machine: the last
    # stuck call then waited ~0.5 s for the budget to refill.
    deadline = time.monotonic() + 30
    while len(load.records) < 100 and time.monotonic() < deadline:
        time.sleep(0.05)
    t_pause = time.monotonic()
    os.killpg(procs["a"].pid, signal.SIGSTOP)
    time.sleep(3)
    os.killpg(procs["a"].pid, signal.SIGCONT)
    t_resume = time.monotonic()
    load.wait("a back in rotation", lambda c: bool(c[ta] and c[tb]), timeout=60)
    outcomes, _ = load.window(t_pause - 0.5, t_resume)
    slowest = max(d for t0, d in load.seconds if t_pause - 0.5 <= t0 < t_resume)
    hedges = (log_dir / "gateway.log").read_text()
    print(f"paused 3 s: {dict(outcomes)}, slowest call {slowest * 1e3:.0f} ms")
    assert set(outcomes) == {"OK"}, outcomes
    assert slowest < DEADLINE_S / 2, slowest  # the deadline is 1 s: no call waited it out
    assert "out of rotation" in hedges  # the probes took the paused replica out meanwhile


@contextlib.contextmanager
def held_calls(cfg: Any, body: bytes, threads: int = 3) -> Iterator[list[tuple[float, float, str]]]:
    """Threads calling ``cfg``'s TorchServe directly with ``body`` (the whole sample: long
    calls, so some are always in flight), back to back, until the block ends; yields the
    ``(start, end, outcome)`` of every call, filled as they end."""
    key, model = inference_key(cfg.key_file), (cfg.model_name, cfg.model_version)
    records: list[tuple[float, float, str]] = []
    stop = threading.Event()

    def run(channel: grpc.Channel) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                score(channel, model, body, 10.0, key)
                outcome = "OK"
            except grpc.RpcError as e:
                outcome = e.code().name
            records.append((t0, time.monotonic(), outcome))

    with grpc.insecure_channel(cfg.grpc_inference_target) as channel:
        workers = [threading.Thread(target=run, args=(channel,)) for _ in range(threads)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 60
        while sum(o == "OK" for *_, o in records) < 3 * threads:
            assert time.monotonic() < deadline, (
                f"direct calls to a: {Counter(o for *_, o in records)}"
            )
            time.sleep(0.05)
        try:
            yield records
        finally:
            stop.set()
            for w in workers:
                w.join()


def stopping_a_replica_fails_nothing(r: Replicas) -> None:
    """Stop replica a under load, restart it: every call succeeds (a drains: java alone is
    signalled, answers the calls its workers hold and closes its port, so the gateway's next
    call to it is refused at once and goes to b), the survivor alone carries the traffic, and a
    comes back into rotation."""
    load, procs, a, ta, tb = r.load, r.procs, r.cfgs["a"], r.ta, r.tb
    t_both = load.wait("both replicas answering", lambda c: bool(c[ta] and c[tb]))
    with held_calls(
        a, r.sample
    ) as direct:  # a's own gRPC port: what a replica does with calls it holds
        t_stop = time.monotonic()
        process.stop(procs["a"], timeout=10)
        t_gone = time.monotonic()  # (a draining replica may still answer until here)
    held = [o for t0, t1, o in direct if t0 < t_stop < t1]
    after = {o for t0, _, o in direct if t0 >= t_stop}
    print(f"stopping a: {len(held)} calls held, {dict(Counter(held))}; later calls: {after}")
    assert held and set(held) == {"OK"}, held  # were: INTERNAL "Worker died", DEADLINE_EXCEEDED
    assert after <= {"OK", "UNAVAILABLE"}, after  # answered or refused, none left to a deadline
    # the survivor alone carries the traffic for a while (at least 20 calls)
    load.wait("b alone", lambda c: c[tb] >= 20 and not c[ta])
    t_restart = time.monotonic()
    procs["a"] = start_torchserve(a)  # new keys: the gateway must re-read them
    # back in rotation after a probe (every 1 s) once the channel reconnects (backoff
    # capped at 1 s); a loaded CI machine may need some slack
    t_back = load.wait("a back in rotation", lambda c: bool(c[ta] and c[tb]))
    # and kept there: both keep answering (a cold restarted replica is slow at first, and on a
    # loaded machine its next calls may come seconds later: wait for them, bounded)
    deadline = time.monotonic() + 60
    while min(load.window(t_back)[1][t] for t in (ta, tb)) < 5:
        assert time.monotonic() < deadline, f"a left rotation again: {load.window(t_back)}"
        time.sleep(0.1)
    t_end = time.monotonic()
    print(
        f"a stopped for {t_restart - t_stop:.1f} s, back {t_back - t_restart:.1f} s after restart"
    )
    outcomes, by_backend = load.window(t_both - 1, t_stop)
    assert set(outcomes) == {"OK"} and set(by_backend) == {ta, tb}, (outcomes, by_backend)
    # The stop (the calls a held included) and the restart window: every call succeeds with
    # the export's scores. Signalling a's workers with java failed the calls they held
    # ("Worker died") and left the others to the deadline.
    outcomes, _ = load.window(t_stop - DEADLINE_S, t_end)
    assert set(outcomes) == {"OK"}, outcomes
    _, by_backend = load.window(t_gone, t_restart)
    assert set(by_backend) == {tb}, by_backend  # nothing reached the stopped replica
    _, by_backend = load.window(t_back, t_end)
    assert by_backend[ta] > 0 and by_backend[tb] > 0, by_backend
