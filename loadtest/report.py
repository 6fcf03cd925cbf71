"""Locust CSVs -> summary numbers, the step-load knee, and a latency/throughput plot."""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _num(x: str) -> float:
    try:
        return float(x)
    except ValueError:  # "N/A" before the first request
        return float("nan")


def summarize(prefix: Path) -> dict[str, Any]:
    """``<prefix>_stats.csv`` (Aggregated row) + ``<prefix>_failures.csv`` -> summary fields.

    Locust's percentiles are bucketed: whole ms under 100 ms, 10 ms steps up to 1 s.
    """
    with Path(f"{prefix}_stats.csv").open() as f:
        agg = next((r for r in csv.DictReader(f) if r["Name"] == "Aggregated"), None)
    if agg is None:
        raise ValueError(f"{prefix}_stats.csv: no Aggregated row (did Locust run?)")
    by_type: dict[str, int] = {}
    failures = Path(f"{prefix}_failures.csv")
    if failures.exists():
        with failures.open() as f:
            for r in csv.DictReader(f):
                key = _failure_type(r["Error"])
                by_type[key] = by_type.get(key, 0) + int(r["Occurrences"])
    requests = int(agg["Request Count"])
    return {
        "requests": requests,
        "failures": int(agg["Failure Count"]),
        "failure_ratio": int(agg["Failure Count"]) / requests if requests else 0.0,
        "rps": _num(agg["Requests/s"]),
        "p50_ms": _num(agg["50%"]),
        "p95_ms": _num(agg["95%"]),
        "p99_ms": _num(agg["99%"]),
        "max_ms": _num(agg["Max Response Time"]),
        "mean_ms": _num(agg["Average Response Time"]),
        "failures_by_type": by_type,
    }


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


def slo_violation(s: dict[str, Any], p99_ms: float | None, failure_ratio: float | None) -> str:
    """'' when within the limits, else a one-line reason."""
    if s["requests"] == 0:
        return "no requests completed"
    if failure_ratio is not None and s["failure_ratio"] > failure_ratio:
        return f"failure ratio {s['failure_ratio']:.4f} > limit {failure_ratio}"
    if p99_ms is not None and not s["p99_ms"] <= p99_ms:
        return f"p99 {s['p99_ms']:g} ms > limit {p99_ms:g} ms"
    return ""


def knee(
    steps: Sequence[dict[str, Any]], p99_ms: float, failure_ratio: float | None = None
) -> dict[str, Any] | None:
    """The step with the highest throughput whose p99 (and failure ratio) is within the limits."""
    ok = [s for s in steps if not slo_violation(s, p99_ms, failure_ratio)]
    return max(ok, key=lambda s: s["rps"]) if ok else None


def steps_table(steps: Sequence[dict[str, Any]], best: dict[str, Any] | None) -> str:
    lines = [f"{'users':>6} {'rps':>9} {'p50 ms':>7} {'p99 ms':>7} {'fail':>6}"]
    for s in steps:
        mark = "  <- knee" if s is best else ""
        lines.append(
            f"{s['users']:>6} {s['rps']:>9.1f} {s['p50_ms']:>7g} {s['p99_ms']:>7g} "
            f"{s['failures']:>6}{mark}"
        )
    return "\n".join(lines)


def read_history(path: Path) -> dict[str, list[float]]:
    """``*_stats_history.csv`` Aggregated rows -> columns (seconds since start, rps, p50..p99)."""
    cols: dict[str, list[float]] = {k: [] for k in ("t", "users", "rps", "p50", "p95", "p99")}
    with path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["Name"] == "Aggregated"]
    for r in rows:
        cols["t"].append(float(r["Timestamp"]) - float(rows[0]["Timestamp"]))
        cols["users"].append(_num(r["User Count"]))
        cols["rps"].append(_num(r["Requests/s"]))
        for p in ("50", "95", "99"):
            cols[f"p{p}"].append(_num(r[f"{p}%"]))
    return cols


def plot(history: Path, png: Path, title: str) -> None:
    """Latency percentiles (top) and throughput with the user count (bottom) over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h = read_history(history)
    fig, (lat, thr) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    for p in ("p50", "p95", "p99"):
        lat.plot(h["t"], h[p], label=p)
    lat.set_ylabel("latency (ms)")
    lat.legend(loc="upper left")
    lat.set_title(title)
    thr.plot(h["t"], h["rps"], color="black", label="requests/s")
    thr.set_ylabel("requests/s")
    thr.set_xlabel("seconds")
    users = thr.twinx()
    users.plot(h["t"], h["users"], color="gray", linestyle="--", label="users")
    users.set_ylabel("users")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
