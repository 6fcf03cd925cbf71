"""Two TorchServe replicas behind one gateway: stop one under load, then bring it back."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest

from serving.client import build_request
from serving.stubs import ranker_pb2_grpc
from serving.torchserve import process
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


class Load:
    """Threads calling Score in a loop, recording (time, outcome, backend)."""

    def __init__(self, stub: ranker_pb2_grpc.RankerStub, request: object, threads: int = 3) -> None:
        self.stub, self.request = stub, request
        self.records: list[tuple[float, str, str]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run) for _ in range(threads)]

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                _, call = self.stub.Score.with_call(self.request, timeout=10)
                backend = dict(call.initial_metadata()).get("x-recsys-backend", "?")
                self.records.append((t, "OK", backend))
            except grpc.RpcError as e:
                self.records.append((t, e.code().name, ""))
            time.sleep(0.01)

    def window(self, start: float, end: float) -> tuple[Counter[str], Counter[str]]:
        rows = [r for r in self.records if start <= r[0] < end]
        return Counter(r[1] for r in rows), Counter(r[2] for r in rows if r[1] == "OK")


def test_stopping_a_replica_fails_nothing_after_one_deadline(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    export, store, _ = exported
    a, b = torchserve_config(store, tmp_path / "a"), torchserve_config(store, tmp_path / "b")
    procs = {"a": start_torchserve(a), "b": start_torchserve(b)}
    gateway, target = start_gateway(
        export / "schema.json", [a, b], tmp_path / "gateway.log", deadline_s=DEADLINE_S
    )

    s = np.load(export / "sample.npz")
    dense = s["dense"][:8]
    sparse = np.full((8, 26), 7, dtype=np.int64)
    with grpc.insecure_channel(target) as channel:
        load = Load(ranker_pb2_grpc.RankerStub(channel), build_request(dense, sparse))
        try:
            wait_status(target, "SERVING", 60)
            time.sleep(1.5)  # both replicas probed healthy
            for t in load.threads:
                t.start()
            time.sleep(3)
            t_stop = time.monotonic()
            process.stop(procs["a"], timeout=10)
            time.sleep(4)
            t_restart = time.monotonic()
            procs["a"] = start_torchserve(a)
            # Back in rotation after a probe (every 1 s) once the channel reconnects (the gateway
            # caps gRPC's reconnect backoff at 1 s); allow a loaded CI machine some slack.
            t_back = time.monotonic()
            while time.monotonic() - t_back < 20:
                if load.window(time.monotonic() - 1, time.monotonic())[1][a.grpc_inference_target]:
                    break
                time.sleep(0.2)
            time.sleep(2)
            t_end = time.monotonic()
        finally:
            load.stop.set()
            for t in load.threads:
                if t.is_alive():
                    t.join()
            stop_gateway(gateway)
            for p in procs.values():
                process.stop(p)
    outcomes, by_backend = load.window(t_stop - 3, t_stop)
    assert set(outcomes) == {"OK"} and set(by_backend) == {
        a.grpc_inference_target,
        b.grpc_inference_target,
    }
    # After the first deadline, no request fails and the traffic goes on on the other replica.
    outcomes, by_backend = load.window(t_stop + DEADLINE_S + 0.5, t_restart)
    assert set(outcomes) == {"OK"}, outcomes
    assert set(by_backend) == {b.grpc_inference_target} and sum(by_backend.values()) > 20
    # Once a is back (new keys) and probed healthy, traffic returns to both, still without failures.
    outcomes, by_backend = load.window(t_end - 2, t_end)
    assert set(outcomes) == {"OK"}, outcomes
    assert by_backend[a.grpc_inference_target] > 0 and by_backend[b.grpc_inference_target] > 0
    assert not ours(tmp_path)
