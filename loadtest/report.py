"""A run's end-of-run files -> summary numbers; the SLO gate, the step-load knee, a plot.

The figures are Locust's end-of-run stats (``<prefix>_final.json``, written as Locust quits:
``loadtest/tally.py``), not its once-a-second CSVs, which miss the calls of the last second and
of the stop timeout. Throughput and percentiles are of successful calls; failures are counted
and reported apart (count, ratio, by gRPC code, their own latency).
"""

from __future__ import annotations

import csv
import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.tally import FINAL, LOAD

log = logging.getLogger("loadtest")
_LATENCY = ("p50_ms", "p95_ms", "p99_ms", "max_ms", "mean_ms")


def _num(x: str) -> float:
    try:
        return float(x)
    except ValueError:  # "N/A" before the first request
        return float("nan")


def summarize(prefix: Path) -> dict[str, Any]:
    """``<prefix>_final.json`` + each load process's ``<prefix>_load-<pid>.json`` -> summary.

    ``requests`` counts every call, ``failures`` the failed ones; ``rps`` and ``p50_ms`` ..
    ``mean_ms`` are of successful calls only (``successes``), over the run's span: the first
    call's start to the last call's end, as the load processes saw them (Locust keeps no first
    call's time: its stats start when they are made, in a master before the workers connect).
    ``calls_made`` is what the load processes counted themselves; ``unreported_calls`` (when
    not 0) the calls they made that Locust's final stats lack (a worker's last report too late).
    """
    final_path = Path(f"{prefix}{FINAL}")
    if not final_path.exists():
        raise ValueError(f"{final_path}: Locust wrote no end-of-run stats (see its locust.log)")
    final = json.loads(final_path.read_text())
    loads = [
        json.loads(p.read_text()) for p in sorted(prefix.parent.glob(f"{prefix.name}{LOAD}*.json"))
    ]
    ok, failed = final["ok"], final["failed"]
    requests, failures = ok["requests"] + failed["requests"], failed["requests"]
    first = [x["first_call_at"] for x in loads if x["first_call_at"] is not None]
    last = [x["last_call_at"] for x in loads if x["last_call_at"] is not None]
    span = max(last) - min(first) if first else final["locust_span_s"]
    by_type: dict[str, int] = {}
    for e in final["errors"]:
        key = _failure_type(e["error"])
        by_type[key] = by_type.get(key, 0) + int(e["occurrences"])
    nan = float("nan")
    summary: dict[str, Any] = {
        "requests": requests,
        "successes": ok["requests"],
        "failures": failures,
        "failure_ratio": failures / requests if requests else 0.0,
        "rps": ok["requests"] / span if span > 0 else 0.0,
        "failed_rps": failures / span if span > 0 else 0.0,
        **{k: ok.get(k, nan) for k in _LATENCY},
        "failures_by_type": by_type,
        "failed_latency_ms": {k: failed[k] for k in ("p50_ms", "p99_ms", "max_ms") if k in failed},
        "span_s": round(span, 3),
        "span_from": "load processes" if first else "locust",
        "stats": final_path.name,
    }
    if loads:
        made = sum(x["calls"] for x in loads)
        summary["calls_made"], summary["load_processes"] = made, len(loads)
        if made != requests:
            summary["unreported_calls"] = made - requests
            log.warning("%d calls made, %d in Locust's final stats", made, requests)
        summary["working_set"] = loads[0]["working_set"]
    return summary


def workers_seen(master_log: str) -> int:
    """Distinct load workers the Locust master saw reporting ready (its INFO log)."""
    return len(set(re.findall(r"(\S+) \(index \d+\) reported as ready", master_log)))


def _failure_type(error: str) -> str:
    """``GrpcError('UNAVAILABLE: ...')`` -> ``UNAVAILABLE``, ``BadReply(...)`` -> ``BAD_REPLY``;
    anything else as Locust wrote it."""
    if error.startswith("BadReply("):
        return "BAD_REPLY"
    m = re.match(r"\w+\(['\"]([A-Z_]+):", error)
    return m.group(1) if m else error


def slo_violation(s: dict[str, Any], p99_ms: float | None, failure_ratio: float) -> str:
    """'' when within the limits, else one line naming every limit broken (the failure ratio
    first: a run that failed calls has failed, however fast its successes were)."""
    if s["requests"] == 0:
        return "no requests completed"
    broken = []
    if not s["failure_ratio"] <= failure_ratio:
        broken.append(
            f"failure ratio {s['failure_ratio']:.4f} > limit {failure_ratio:g} "
            f"({s['failures']:,} of {s['requests']:,} calls failed)"
        )
    if s["successes"] == 0:
        broken.append("no call succeeded")
    elif p99_ms is not None and not s["p99_ms"] <= p99_ms:
        broken.append(f"p99 {s['p99_ms']:g} ms > limit {p99_ms:g} ms")
    return "; ".join(broken)


def knee(
    steps: Sequence[dict[str, Any]], p99_ms: float, failure_ratio: float
) -> dict[str, Any] | None:
    """The step with the highest throughput of successful calls whose p99 and failure ratio
    are within the limits: an overloaded step that fails its calls is never the knee."""
    ok = [s for s in steps if not slo_violation(s, p99_ms, failure_ratio)]
    return max(ok, key=lambda s: s["rps"]) if ok else None


def steps_table(steps: Sequence[dict[str, Any]], best: dict[str, Any] | None) -> str:
    """Users, successful calls/s and their p50/p99, failures and their share, the knee marked."""
    lines = [f"{'users':>6} {'ok rps':>9} {'p50 ms':>7} {'p99 ms':>7} {'failed':>7} {'ratio':>7}"]
    for s in steps:
        mark = "  <- knee" if s is best else ""
        lines.append(
            f"{s['users']:>6} {s['rps']:>9.1f} {s['p50_ms']:>7g} {s['p99_ms']:>7g} "
            f"{s['failures']:>7} {s['failure_ratio']:>7.2%}{mark}"
        )
    return "\n".join(lines)


def read_history(path: Path) -> dict[str, list[float]]:
    """``*_stats_history.csv`` Aggregated rows -> columns (seconds since start, users, calls/s,
    failed calls/s, p50..p99 of the last seconds, failed calls included: Locust's own curves)."""
    keys = ("t", "users", "rps", "failed", "p50", "p95", "p99")
    cols: dict[str, list[float]] = {k: [] for k in keys}
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["Name"] == "Aggregated"]
    for r in rows:
        cols["t"].append(float(r["Timestamp"]) - float(rows[0]["Timestamp"]))
        cols["users"].append(_num(r["User Count"]))
        cols["rps"].append(_num(r["Requests/s"]))
        cols["failed"].append(_num(r["Failures/s"]))
        for p in ("50", "95", "99"):
            cols[f"p{p}"].append(_num(r[f"{p}%"]))
    return cols


def plot(history: Path, png: Path, title: str) -> None:
    """Latency percentiles (top) and throughput, successful and failed, with the user count
    (bottom) over time: Locust's once-a-second figures, a picture of the run, not its result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = read_history(history)
    fig, (lat, thr) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    for p in ("p50", "p95", "p99"):
        lat.plot(h["t"], h[p], label=p)
    lat.set_ylabel("latency, all calls (ms)")
    lat.legend(loc="upper left")
    lat.set_title(title)
    ok = [a - b for a, b in zip(h["rps"], h["failed"], strict=True)]
    thr.plot(h["t"], ok, color="black", label="successful/s")
    thr.plot(h["t"], h["failed"], color="red", label="failed/s")
    thr.set_ylabel("calls/s")
    thr.legend(loc="upper left")
    thr.set_xlabel("seconds")
    users = thr.twinx()
    users.plot(h["t"], h["users"], color="gray", linestyle="--", label="users")
    users.set_ylabel("users")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
