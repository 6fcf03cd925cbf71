"""Closed-loop load: ``concurrency`` threads, each with its own connection, call back to back.

Each thread connects and makes one untimed call, then all start together (a barrier); the wall
time runs from the barrier to the last thread's end. A failed call is counted, not retried, and
its first message kept; a reply with the wrong number of scores stops the benchmark.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serving.bench.methods import Connect
from serving.bench.model import Payload

MIN_PER_CLIENT = 2


@dataclass
class Cell:
    """Figures of one (method, examples, concurrency), accumulated over rounds."""

    method: str
    examples: int
    concurrency: int
    latencies_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0
    first_error: str = ""
    rounds_examples_per_s: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds each server process group spent in this cell's calls, and ``client``: the
    benchmark process (its client threads, with their connection and one warm-up call each)."""
    machine_s: list[float] = field(default_factory=lambda: [0.0, 0.0])
    """Busy and all CPU seconds of the whole machine (every core) during this cell's calls."""

    def add_machine(self, busy: float, total: float) -> None:
        self.machine_s[0] += busy
        self.machine_s[1] += total

    def add_cpu(self, spent: dict[str, float]) -> None:
        for part, seconds in spent.items():
            self.cpu_s[part] = self.cpu_s.get(part, 0.0) + seconds

    def add(self, latencies_ms: list[float], wall_s: float, errors: list[str]) -> None:
        self.latencies_ms += latencies_ms
        self.wall_s += wall_s
        self.errors += len(errors)
        self.first_error = self.first_error or (errors[0] if errors else "")
        self.rounds_examples_per_s.append(len(latencies_ms) * self.examples / wall_s)

    def figures(self) -> dict[str, Any]:
        ms = np.asarray(self.latencies_ms or [math.nan])
        done = len(self.latencies_ms)
        return {
            "requests": done,
            "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)),
            "examples_per_s": done * self.examples / self.wall_s if self.wall_s else 0.0,
            "requests_per_s": done / self.wall_s if self.wall_s else 0.0,
            "errors": self.errors,
            "cpu_ms_per_request": {part: 1e3 * s / done for part, s in self.cpu_s.items() if done},
            # clamped: the kernel's idle time can step back over a few ticks (NO_HZ accounting)
            "machine_busy": min(1.0, max(0.0, self.machine_s[0] / self.machine_s[1]))
            if self.machine_s[1]
            else None,
        }


def run_cell(
    connect: Connect, payload: Payload, concurrency: int, requests: int
) -> tuple[list[float], float, list[str]]:
    """``(latencies ms, wall s, error messages)`` of ``requests`` calls over ``concurrency``."""
    per = max(MIN_PER_CLIENT, math.ceil(requests / concurrency))
    start = threading.Barrier(concurrency + 1)
    lock = threading.Lock()
    latencies: list[float] = []
    errors: list[str] = []
    failed: list[BaseException] = []

    def client() -> None:
        mine: list[float] = []
        bad: list[str] = []
        try:
            call, close = connect(payload)
        except BaseException as e:  # reported by the main thread
            failed.append(e)
            start.abort()
            return
        try:
            _check(call(), payload.examples)  # warm the connection, check the answer
            start.wait()
            for _ in range(per):
                t0 = time.perf_counter()
                try:
                    n = call()
                except Exception as e:  # a transport or server error: counted
                    bad.append(f"{type(e).__name__}: {e}"[:300])
                    continue
                mine.append((time.perf_counter() - t0) * 1e3)
                _check(n, payload.examples)
        except threading.BrokenBarrierError:
            return
        except BaseException as e:  # reported by the main thread
            failed.append(e)
            start.abort()
        finally:
            close()
            with lock:
                latencies.extend(mine)
                errors.extend(bad)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a client failed: reported below
        start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if failed:
        raise RuntimeError(f"a client failed: {type(failed[0]).__name__}: {failed[0]}")
    return latencies, wall, errors


def _check(scores: int, examples: int) -> None:
    if scores != examples:
        raise RuntimeError(f"{scores} scores for a request of {examples} examples")
