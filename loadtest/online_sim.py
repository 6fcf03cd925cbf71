"""``python -m loadtest.online_sim``: simulated users for the closed loop (issue 49).

Users whose clicks follow the synthetic data's planted model (:mod:`training.data.planted`, the
same spec and seed the model was first trained on): each request is ``--examples`` rows drawn from
the world of the moment, scored by the gateway (``Score``: the reply's ``request_id``); each
example is clicked with its true probability, and a click is reported (``Feedback``, its event
time the click's) after an exponential delay of mean ``--click-delay-s``. The world drifts: every
``--day-s`` seconds it moves one synthetic day on (:func:`training.data.drift.next_day`, amount
``--drift``), so a model frozen at the start decays and one trained on the clicks keeps up.

Open loop: ``--rps`` requests a second over ``--callers`` threads, whatever the replies take (a
slow stack shows as latency and failures, not as less traffic). With ``--frozen EXPORT`` each
request is also scored in process by that export (the model the stack started with): every
``--bucket-s`` the progressive AUC of the served scores and of the frozen ones on the same
examples (paired DeLong: ahead / behind / within noise) and the planted model's own (the best any
model can do). Written to ``--out``: ``summary.json`` (calls, failures by code, clicks drawn and
reported, the buckets) and ``buckets.jsonl`` as they close; a line a bucket on stderr.
"""

from __future__ import annotations

import argparse
import heapq
import json
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from recsys_stack.auc_stats import compare_aucs
from recsys_stack.metrics import roc_auc
from serving.stubs import ranker_pb2
from serving.tools.channel import from_env
from serving.tools.client import RankerClient, build_request
from training.data.drift import next_day
from training.data.planted import PlantedModel, SyntheticSpec, build_model, raw_ids, sample_block
from training.features import NUM_SPARSE

FEEDBACK_EVERY_S = 0.2  # clicks due are reported in one call this often
MAX_CLICKS_PER_CALL = 1000


class World:
    """The planted model of the moment: day ``(t - t0) // day_s``, drifted day by day."""

    def __init__(self, spec: SyntheticSpec, day_s: float, drift: float) -> None:
        self.spec, self.day_s, self.drift = spec, day_s, drift
        self.days: list[PlantedModel] = [build_model(spec)]
        self.t0 = time.time()
        self._lock = threading.Lock()

    def day(self, t: float) -> int:
        return 0 if self.day_s <= 0 else max(0, int((t - self.t0) // self.day_s))

    def model(self, t: float) -> PlantedModel:
        d = self.day(t)
        with self._lock:  # one thread draws the next day; the others wait for it
            while len(self.days) <= d:
                self.days.append(next_day(self.days[-1], self.spec, self.drift, len(self.days)))
            return self.days[d]


def draw(
    world: World, rng: np.random.Generator, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` users of the moment: raw dense ``float32[n, 13]``, raw ids ``int64[n, 26]`` (-1 =
    missing) and the true click probabilities ``float64[n]``."""
    block = sample_block(world.model(time.time()), world.spec, rng, n)
    ids = np.full((n, NUM_SPARSE), -1, np.int64)
    for f in range(NUM_SPARSE):
        present = block.ranks[:, f] >= 0
        ids[present, f] = raw_ids(f, block.ranks[present, f])
    return block.dense.astype(np.float32), ids, block.prob


@dataclass(order=True)
class Click:
    due: float
    request_id: str = field(compare=False)
    example: int = field(compare=False)


@dataclass
class Bucket:
    """The examples scored in one ``--bucket-s`` interval: labels drawn, served and frozen scores."""

    start: float
    labels: list[np.ndarray] = field(default_factory=list)
    served: list[np.ndarray] = field(default_factory=list)
    frozen: list[np.ndarray] = field(default_factory=list)
    truth: list[np.ndarray] = field(default_factory=list)
    versions: Counter[str] = field(default_factory=Counter)

    def summary(self, t0: float, day: int) -> dict[str, Any]:
        y = np.concatenate(self.labels) if self.labels else np.zeros(0)
        out: dict[str, Any] = {"t_s": round(self.start - t0, 1), "day": day, "examples": int(y.size),
                               "clicks": int(y.sum()), "versions": dict(self.versions)}  # fmt: skip
        if y.size == 0 or y.min() == y.max():
            return out
        served, truth = np.concatenate(self.served), np.concatenate(self.truth)
        out["auc_served"] = round(roc_auc(y, served), 4)
        out["auc_planted"] = round(roc_auc(y, truth), 4)
        if self.frozen:
            frozen = np.concatenate(self.frozen)
            out["auc_frozen"] = round(roc_auc(y, frozen), 4)
            out["served_vs_frozen"] = str(compare_aucs(y, served, frozen))
        return out


class Simulator:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        spec = SyntheticSpec(seed=a.seed, vocab_sizes=list(a.vocab_sizes))
        self.world = World(spec, a.day_s, a.drift)
        self.client = RankerClient(a.target, timeout=a.timeout_s, channel=from_env())
        self.frozen = _frozen(a.frozen) if a.frozen else None
        self.stop = threading.Event()  # the callers stop
        self.callers_done = threading.Event()  # then the reporter sends what is left
        self.lock = threading.Lock()
        self.clicks: list[Click] = []
        self.codes: Counter[str] = Counter()
        self.feedback_codes: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()
        self.bucket = Bucket(time.time())
        self.buckets: list[dict[str, Any]] = []
        a.out.mkdir(parents=True, exist_ok=True)
        self.bucket_log = (a.out / "buckets.jsonl").open("a", buffering=1)

    def call(self, rng: np.random.Generator) -> None:
        dense, ids, prob = draw(self.world, rng, self.a.examples)
        request = build_request(dense, ids)
        try:
            reply = self.client.stub.Score(
                request, timeout=self.client.timeout, metadata=self.client.metadata
            )
        except grpc.RpcError as e:
            with self.lock:
                self.codes[e.code().name] += 1  # type: ignore[attr-defined]
            return
        now = time.time()
        labels = (rng.random(len(prob)) < prob).astype(np.int8)
        frozen = self.frozen(dense, ids) if self.frozen is not None else None
        delays = rng.exponential(self.a.click_delay_s, len(prob))
        with self.lock:
            self.codes["OK"] += 1
            self.counts["impressions"] += len(prob)
            self.counts["clicks_drawn"] += int(labels.sum())
            for i in np.flatnonzero(labels):
                heapq.heappush(self.clicks, Click(now + float(delays[i]), reply.request_id, int(i)))
            b = self.bucket
            b.labels.append(labels)
            b.served.append(np.asarray(reply.scores, np.float64))
            b.truth.append(prob)
            b.versions[reply.model_version] += 1
            if frozen is not None:
                b.frozen.append(frozen)
            if now - b.start >= self.a.bucket_s:
                self.close_bucket(now)

    def close_bucket(self, now: float) -> None:
        s = self.bucket.summary(self.world.t0, self.world.day(self.bucket.start))
        self.buckets.append(s)
        self.bucket_log.write(json.dumps(s) + "\n")
        auc = " ".join(f"{k[4:]} {s[k]:.4f}" for k in ("auc_served", "auc_frozen", "auc_planted")
                       if k in s)  # fmt: skip
        print(f"online-sim: t={s['t_s']:.0f}s day {s['day']}: {s['examples']} examples, "
              f"{s['clicks']} clicks, AUC {auc or 'n/a'}; calls {dict(self.codes)}, clicks "
              f"reported {self.counts['clicks_reported']}", file=sys.stderr, flush=True)  # fmt: skip
        self.bucket = Bucket(now)

    def caller(self, k: int) -> None:
        rng = np.random.default_rng([self.a.seed, 7, k])
        period = self.a.callers / self.a.rps
        next_at = time.monotonic() + rng.random() * period
        while not self.stop.is_set():
            delay = next_at - time.monotonic()
            if delay > 0 and self.stop.wait(delay):
                break
            next_at = max(next_at + period, time.monotonic() - period)  # no burst after a stall
            self.call(rng)

    def reporter(self) -> None:
        while True:
            stopping = self.callers_done.wait(FEEDBACK_EVERY_S)
            now = time.time()
            with self.lock:
                due: list[Click] = []
                while (
                    self.clicks
                    and len(due) < MAX_CLICKS_PER_CALL
                    and (self.clicks[0].due <= now or (stopping and self.a.drain))
                ):
                    due.append(heapq.heappop(self.clicks))
            if due:
                self.report(due)
            elif stopping:
                return

    def report(self, due: list[Click]) -> None:
        clicks = [ranker_pb2.Click(request_id=c.request_id, example=c.example, label=1,
                                   event_time_ms=int(c.due * 1000)) for c in due]  # fmt: skip
        try:
            self.client.stub.Feedback(ranker_pb2.FeedbackRequest(clicks=clicks),
                                      timeout=self.client.timeout, metadata=self.client.metadata)  # fmt: skip
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name  # type: ignore[attr-defined]
        with self.lock:
            self.feedback_codes[code] += 1
            self.counts["clicks_reported" if code == "OK" else "clicks_lost"] += len(due)

    def run(self) -> dict[str, Any]:
        threads = [threading.Thread(target=self.caller, args=(k,), daemon=True)
                   for k in range(self.a.callers)]  # fmt: skip
        reporter = threading.Thread(target=self.reporter, daemon=True)
        for t in [*threads, reporter]:
            t.start()
        end = time.monotonic() + self.a.duration_s if self.a.duration_s > 0 else float("inf")
        while not self.stop.wait(min(1.0, max(0.0, end - time.monotonic()))):
            if time.monotonic() >= end:
                break
        self.stop.set()
        for t in threads:  # a call in flight may still draw clicks
            t.join(self.a.timeout_s + 5)
        self.callers_done.set()
        reporter.join(self.a.timeout_s * (1 + len(self.clicks) // MAX_CLICKS_PER_CALL) + 5)
        with self.lock:
            self.close_bucket(time.time())
            summary = {"seconds": round(time.time() - self.world.t0, 1), "calls": dict(self.codes),
                       "feedback_calls": dict(self.feedback_codes), **self.counts,
                       "clicks_pending": len(self.clicks), "days": len(self.world.days),
                       "buckets": self.buckets}  # fmt: skip
        (self.a.out / "summary.json").write_text(json.dumps(summary, indent=1))
        self.client.close()
        return summary


def _frozen(export: Path) -> Any:
    """A scorer of raw features by ``export`` (its portable or mapped variant), in process."""
    import torch

    from serving.worker.scoring import ScoringModel

    schema = json.loads((export / "schema.json").read_text())
    variant = schema["variants"][schema["serving"]["cpu"]]  # what a CPU worker serves
    model = ScoringModel(export, variant["file"], torch.device("cpu"))

    def score(dense: np.ndarray, ids: np.ndarray) -> np.ndarray:
        present = ids.T >= 0  # feature-major, as the wire codec groups them
        values = torch.from_numpy(np.ascontiguousarray(ids.T[present]))
        lengths = torch.from_numpy(present.astype(np.int32))
        with torch.inference_mode():
            p = model.forward((torch.from_numpy(dense), values, lengths))
        return p.numpy().astype(np.float64)

    return score


def duration(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``1h`` -> seconds (0 = until stopped)."""
    unit = {"s": 1, "m": 60, "h": 3600}.get(text[-1:], 0)
    try:
        return float(text[:-1]) * unit if unit else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration like 90s, 10m or 1h") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.online_sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--target", default="127.0.0.1:50051", help="the gateway (default %(default)s)")
    p.add_argument(
        "--rps", type=float, default=20.0, help="requests a second (default %(default)s)"
    )
    p.add_argument(
        "--examples", type=int, default=50, help="examples a request (default %(default)s)"
    )
    p.add_argument("--callers", type=int, default=4, help="caller threads (default %(default)s)")
    p.add_argument("--duration", dest="duration_s", type=duration, default=0.0,
                   help="how long (90s, 10m; default: until SIGINT/SIGTERM)")  # fmt: skip
    p.add_argument("--click-delay-s", type=float, default=5.0,
                   help="mean delay from a score to its click (exponential; default %(default)s)")  # fmt: skip
    p.add_argument(
        "--seed", type=int, default=0, help="the planted model's seed (default %(default)s)"
    )
    p.add_argument("--vocab", dest="vocab_sizes", type=int, nargs="+", default=[1000] * NUM_SPARSE,
                   help="ids per sparse feature: 1 or 26 numbers (default 1000: the demo preset's data)")  # fmt: skip
    p.add_argument("--day-s", type=float, default=120.0,
                   help="seconds a synthetic day lasts (the world drifts a day; 0 = never)")  # fmt: skip
    p.add_argument(
        "--drift", type=float, default=0.1, help="drift a day, in [0, 1] (default %(default)s)"
    )
    p.add_argument(
        "--frozen", type=Path, help="an export folder scored in process beside the stack"
    )
    p.add_argument(
        "--bucket-s", type=float, default=30.0, help="AUC bucket (default %(default)s s)"
    )
    p.add_argument("--timeout-s", type=float, default=5.0, help="per call (default %(default)s)")
    p.add_argument("--no-drain", dest="drain", action="store_false",
                   help="at the end, drop the clicks not yet due (default: report them at once)")  # fmt: skip
    p.add_argument(
        "--out", type=Path, default=Path("reports/online-sim"), help="(default %(default)s)"
    )
    a = p.parse_args(argv)
    if len(a.vocab_sizes) == 1:
        a.vocab_sizes = a.vocab_sizes * NUM_SPARSE
    if len(a.vocab_sizes) != NUM_SPARSE or min(a.vocab_sizes) < 1:
        p.error(f"--vocab: 1 or {NUM_SPARSE} positive numbers, got {len(a.vocab_sizes)}")
    if a.rps <= 0 or a.examples < 1 or a.callers < 1 or not 0.0 <= a.drift <= 1.0:
        p.error("--rps > 0, --examples >= 1, --callers >= 1 and --drift in [0, 1]")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    sim = Simulator(a)
    signal.signal(signal.SIGTERM, lambda *_: sim.stop.set())
    signal.signal(signal.SIGINT, lambda *_: sim.stop.set())
    s = sim.run()
    print(json.dumps({k: v for k, v in s.items() if k != "buckets"}))
    failed = sum(n for c, n in s["calls"].items() if c != "OK")
    return 1 if failed or s.get("clicks_lost") else 0


if __name__ == "__main__":
    sys.exit(main())
