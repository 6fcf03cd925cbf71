"""The feature log: every scored example of a sampled request, as served, off the request path.

The closed loop (docs/online.md) trains on what the model scored: the Flink joiner reads the
impressions written here and the clicks ``Feedback`` writes (serving/gateway/feedback.py), joins
them by (request id, example) and hands labelled rows to the continuous trainer. The record
formats are :mod:`recsys_stack.online`'s.

The scoring path only *enqueues references* (:meth:`FeatureLog.scored`: the request's arrays,
its id, version, scores and time; no copy, no formatting): a deque append under the GIL. One
thread (``feature-log``) takes them, formats the JSON lines and writes them to rolling files
(serving/gateway/featurelog_files.py). Formatting 30-60k examples a second in Python would hold
the GIL the event loop needs, so the lines are written by ``_fastwire.impressions`` (C, the GIL
released; :func:`format_impressions` is its Python twin, used when the extension is not built
and by the tests as the reference). The queue is bounded in examples (``queue_examples``): a
request that does not fit is dropped and counted, never waited for; a call never fails because
of the log. On SIGTERM the gateway drains the queue and closes its files (:meth:`close`).

Sampling is by request (all of its examples or none), decided from its id
(:meth:`RequestIds.sampled`), so a click can be matched to the sample by any gateway.
Metrics (``recsys_gateway_feature_log_*``) are plain counters read at scrape time.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from recsys_stack.online import CLICKS, IMPRESSIONS, criteo_row
from serving.gateway.featurelog_config import FeatureLogConfig
from serving.gateway.featurelog_files import RollingFiles
from serving.gateway.request_ids import RequestIds, base36, load_key

try:  # the C formatter; absent when no C compiler built the extension
    from serving.gateway import _fastwire
except ImportError:  # pragma: no cover - depends on the install
    _fastwire = None  # type: ignore[assignment]

logger = logging.getLogger("serving.gateway.featurelog")
PREFIX = "recsys_gateway_feature_log"
POLL_S = 0.05  # the writer thread's sleep when the queue is empty (ages are checked as often)


def request_ids(cfg: FeatureLogConfig) -> RequestIds:
    """The ids of this gateway: under the stack's key when the log is on or a key file is
    named (KeyFileError when it cannot be used), else under a key of this process."""
    if cfg.enabled or cfg.key_file:
        return RequestIds(load_key(cfg.key_path))
    return RequestIds.own()


def writer_id() -> str:
    """This process, unique on the stack: ``<host>-<pid>-<start ms, base 36>``."""
    host = "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}-{base36(time.time_ns() // 1_000_000)}"


@functools.lru_cache(maxsize=256)
def _version_json(model: str, version: str) -> str:
    return f', "model": {json.dumps(model)}, "version": {json.dumps(version)}, "score": '


def heads(request_id: str, ms: int, model: str, version: str) -> tuple[bytes, bytes]:
    """The JSON around a line's example index: before it, and between it and the score (as
    ``json.dumps`` writes an impression's fields: :mod:`recsys_stack.online`'s order)."""
    head = f'{{"request_id": {json.dumps(request_id)}, "example": '
    return head.encode(), f', "event_time_ms": {ms}{_version_json(model, version)}'.encode()


def _score(s: float) -> str:
    return format(s, ".9g") if np.isfinite(s) else "null"  # .9g: a float32 read back exactly


def format_impressions(
    head: bytes, mid: bytes, dense: np.ndarray, values: np.ndarray, lengths: np.ndarray,
    scores: np.ndarray,
) -> tuple[bytes, list[int]]:  # fmt: skip
    """``_fastwire.impressions`` in Python: (the lines of the examples a Criteo row holds, the
    indices of those it does not). Shapes: dense f32[B, D], values i64[N], lengths i32[F, B]."""
    b_n = scores.shape[0]
    starts = np.concatenate(([0], np.cumsum(lengths.reshape(-1))))  # feature-major
    out, odd = [], []
    for b in range(b_n):
        sparse = [
            values[starts[f * b_n + b] : starts[f * b_n + b + 1]].tolist()
            for f in range(lengths.shape[0])
        ]
        row = criteo_row(dense[b].tolist(), sparse)
        if row is None:
            odd.append(b)
            continue
        line = f'{b}{mid.decode()}{_score(float(scores[b]))}, "row": {json.dumps(row)}}}\n'
        out.append(head + line.encode())
    return b"".join(out), odd


def odd_lines(
    request_id: str, ms: int, model: str, version: str, arrays: Any, scores: np.ndarray,
    odd: list[int],
) -> bytes:  # fmt: skip
    """Impressions no Criteo row holds: the features as served in ``dense`` and ``sparse``."""
    dense, values, lengths = arrays
    b_n = scores.shape[0]
    starts = np.concatenate(([0], np.cumsum(lengths.reshape(-1))))
    lines = []
    for b in odd:
        sparse = [values[starts[f * b_n + b] : starts[f * b_n + b + 1]].tolist()
                  for f in range(lengths.shape[0])]  # fmt: skip
        record = {"request_id": request_id, "example": b, "event_time_ms": ms, "model": model,
                  "version": version, "score": float(scores[b]), "dense": dense[b].tolist(),
                  "sparse": sparse, "row": None}  # fmt: skip
        lines.append(json.dumps(record) + "\n")
    return "".join(lines).encode()


class FeatureLog:
    """The queue and the thread writing impressions and clicks for one gateway process."""

    def __init__(self, cfg: FeatureLogConfig, model: str, ids: RequestIds) -> None:
        self.cfg, self.model, self.ids = cfg, model, ids
        self.writer = writer_id()
        root = Path(cfg.dir)
        files = (cfg.max_file_bytes, cfg.max_file_age_s, cfg.max_files)
        self.files = {
            kind: RollingFiles(root / kind, kind, self.writer, *files)
            for kind in (IMPRESSIONS, CLICKS)
        }
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self.queued = 0  # examples (and clicks) enqueued: the event loop's thread only
        self.taken = 0  # ... and taken: the writer thread's only (their difference: waiting)
        self.logged = {IMPRESSIONS: 0, CLICKS: 0}  # records written (writer thread)
        self.dropped_full = 0  # impressions not enqueued: the queue was full (loop thread)
        self.lost = {IMPRESSIONS: 0, CLICKS: 0}  # records a write error lost (writer thread)
        self.clicks_accepted = 0
        self.clicks_refused: dict[str, int] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feature-log", daemon=True)
        self._thread.start()
        logger.info(
            "feature log on: %s (writer %s, sample %g, files close at %d bytes or %g s)",
            root.resolve(), self.writer, cfg.sample, cfg.max_file_bytes, cfg.max_file_age_s,
        )  # fmt: skip

    @property
    def waiting(self) -> int:
        """Examples and clicks enqueued and not yet taken by the writer."""
        return self.queued - self.taken

    def sampled(self, request_id: str) -> bool:
        return RequestIds.sampled(request_id, self.cfg.sample)

    def scored(
        self, request_id: str, arrays: Any, version: str, scores: np.ndarray, ms: int
    ) -> None:
        """Log a scored request's examples (the hot path: a reference enqueued, or the request
        dropped from the log when the queue is full). Called on the event loop's thread."""
        if not self.sampled(request_id):
            return
        n = int(scores.shape[0])
        if self.queued + n - self.taken > self.cfg.queue_examples:
            self.dropped_full += n
            return
        self.queued += n
        self._queue.append((IMPRESSIONS, n, request_id, arrays, version, scores, ms))

    def clicks(self, lines: bytes, n: int) -> bool:
        """Enqueue ``n`` click records (JSON lines); False when the queue has no room."""
        if self.queued + n - self.taken > self.cfg.queue_examples:
            return False
        self.queued += n
        self._queue.append((CLICKS, n, lines))
        return True

    def _format(self, item: tuple[Any, ...]) -> bytes:
        _, _, request_id, arrays, version, scores, ms = item
        dense, values, lengths = arrays
        head, mid = heads(request_id, ms, self.model, version)
        parts = (
            np.ascontiguousarray(dense, "<f4"), np.ascontiguousarray(values, "<i8"),
            np.ascontiguousarray(lengths, "<i4"), np.ascontiguousarray(scores, "<f4"),
        )  # fmt: skip
        if _fastwire is not None:
            data, odd = _fastwire.impressions(head, mid, *parts)
        else:
            data, odd = format_impressions(head, mid, *parts)
        if odd:
            data += odd_lines(request_id, ms, self.model, version, arrays, scores, odd)
        return data

    def _drain(self) -> int:
        """Write what is queued; how many items were taken."""
        taken = 0
        while self._queue:
            item = self._queue.popleft()
            kind, n = item[0], item[1]
            try:
                data = item[2] if kind == CLICKS else self._format(item)
                self.files[kind].write(data)
                self.logged[kind] += n
            except OSError as e:
                self.lost[kind] += n
                logger.error("feature log: %d %s lost: %s", n, kind, e.strerror or e)
            except Exception:  # a bug must not stop the thread: every later record would pile up
                self.lost[kind] += n
                logger.exception("feature log: %d %s lost", n, kind)
            self.taken += n
            taken += 1
        return taken

    def _tick(self) -> None:
        for files in self.files.values():
            try:
                files.tick()
            except OSError as e:
                logger.error("feature log: closing a %s file: %s", files.kind, e.strerror or e)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._drain():
                self._stop.wait(POLL_S)
            self._tick()
        self._drain()
        for files in self.files.values():
            try:
                files.close()
            except OSError as e:
                logger.error("feature log: closing a %s file: %s", files.kind, e.strerror or e)

    def close(self, timeout: float = 60.0) -> None:
        """Write everything queued, close the open files (renamed into view), end the thread."""
        self._stop.set()
        self._thread.join(timeout)
        logger.info(
            "feature log closed: %d impressions, %d clicks written; %d dropped (queue full)",
            self.logged[IMPRESSIONS], self.logged[CLICKS], self.dropped_full,
        )  # fmt: skip


class FeatureLogCollector(Collector):
    """``recsys_gateway_feature_log_*``, read from the log's counters at scrape time."""

    def __init__(self, log: FeatureLog) -> None:
        self.log = log

    def collect(self) -> Iterator[Metric]:
        log = self.log
        logged = CounterMetricFamily(
            f"{PREFIX}_impressions", "impressions written to the feature log"
        )
        logged.add_metric([], log.logged[IMPRESSIONS])
        dropped = CounterMetricFamily(
            f"{PREFIX}_dropped", "records not logged, by kind and reason (queue_full: the "
            "queue was full; write_error: a write failed)", labels=["kind", "reason"],
        )  # fmt: skip
        dropped.add_metric([IMPRESSIONS, "queue_full"], log.dropped_full)
        for kind in (IMPRESSIONS, CLICKS):
            dropped.add_metric([kind, "write_error"], log.lost[kind])
        accepted = CounterMetricFamily(f"{PREFIX}_clicks_accepted", "Feedback clicks accepted")
        accepted.add_metric([], log.clicks_accepted)
        written = CounterMetricFamily(f"{PREFIX}_clicks_written", "clicks written to the log")
        written.add_metric([], log.logged[CLICKS])
        refused = CounterMetricFamily(
            f"{PREFIX}_clicks_refused", "Feedback clicks refused, by reason", labels=["reason"]
        )
        for reason, n in list(log.clicks_refused.items()):
            refused.add_metric([reason], n)
        closed = CounterMetricFamily(f"{PREFIX}_files_closed", "log files closed", labels=["kind"])
        deleted = CounterMetricFamily(
            f"{PREFIX}_files_deleted", "closed log files deleted by retention (max_files)",
            labels=["kind"],
        )  # fmt: skip
        for kind, files in log.files.items():
            closed.add_metric([kind], files.closed)
            deleted.add_metric([kind], files.deleted)
        waiting = GaugeMetricFamily(f"{PREFIX}_queued", "examples and clicks waiting to be written")
        waiting.add_metric([], log.waiting)
        yield from (logged, dropped, accepted, written, refused, closed, deleted, waiting)


def register(registry: CollectorRegistry, log: FeatureLog) -> None:
    """Export ``log``'s counters from ``registry``."""
    registry.register(FeatureLogCollector(log))
