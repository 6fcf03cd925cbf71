"""The chaos run's numbers: per-call records + fault events -> report, verdict, table, plot.

Pure functions of what the run recorded (``requests-*.csv`` from the chaos locustfile, the
fault events, the gateways' RSS samples), so that tests can check them on small inputs.

Definitions (all times wall clock; a call belongs to the phase in which it *ended*, so a call
in flight when a fault hit counts against that fault):

- phase k: from fault k to fault k+1 (phase 0: before the first fault);
- ``recover_s``: from the fault to the end of the last failed call of its phase (0: none failed);
- ``ready_s``: from the fault until the component could serve again (see ``loadtest/faults.py``);
- ``rotation_s``: from ``ready`` until a successful call answered by that replica ended
  (``x-recsys-backend``): how long the gateway kept a ready replica out of rotation;
- RSS growth: the gateway's last sample over its first sample ``warmup_s`` into the load;
- hedges: second copies of slow TorchServe calls (``recsys_gateway_backend_hedges_total``) over
  the TorchServe calls made, every gateway's last scrape together.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MB = 1024 * 1024
LOG_ENV = "CHAOS_REQUEST_LOG"
"""Where the chaos locustfile writes its per-call records (a folder)."""


@dataclass(frozen=True)
class Call:
    start: float
    ms: float
    code: str
    backend: str

    @property
    def end(self) -> float:
        return self.start + self.ms / 1000.0

    @property
    def ok(self) -> bool:
        return self.code == "OK"


def read_calls(folder: Path) -> list[Call]:
    """Every ``requests-*.csv`` line in ``folder`` (a torn last line is skipped), by end time."""
    calls = []
    for path in sorted(folder.glob("requests-*.csv")):
        for line in path.read_text().splitlines():
            parts = line.split(",")
            if len(parts) == 4 and parts[2]:
                try:
                    calls.append(Call(float(parts[0]), float(parts[1]), parts[2], parts[3]))
                except ValueError:
                    continue
    return sorted(calls, key=lambda c: c.end)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0-100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def stats(calls: Sequence[Call]) -> dict[str, Any]:
    """Counts, failures by code and latency percentiles (ms, successful calls) of ``calls``."""
    ok = [c.ms for c in calls if c.ok]
    codes = Counter(c.code for c in calls if not c.ok)
    n = len(calls)
    p50, p99 = percentile(ok, 50), percentile(ok, 99)
    return {
        "requests": n,
        "failures": n - len(ok),
        "success_ratio": len(ok) / n if n else None,
        "failures_by_code": dict(sorted(codes.items())),
        "p50_ms": None if p50 is None else round(p50, 2),
        "p99_ms": None if p99 is None else round(p99, 2),
        "max_ms": round(max((c.ms for c in calls), default=0.0), 2),
    }


def _rel(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def phases(
    calls: Sequence[Call], events: Sequence[dict[str, Any]], t0: float, end: float
) -> list[dict[str, Any]]:
    """One entry per phase: its bounds (s since ``t0``), the fault opening it, its stats."""
    # a fault that landed after the last call: an empty last phase, no call counted twice
    bounds = [t0, *(e["at"] for e in events), max(end, t0, *(e["at"] for e in events))]
    out = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        last = k == len(bounds) - 2
        inside = [c for c in calls if lo <= c.end < hi or (last and c.end >= hi)]
        out.append({
            "phase": k, "after": events[k - 1]["fault"] if k else "start",
            "from_s": _rel(lo, t0), "to_s": _rel(hi, t0), **stats(inside),
        })  # fmt: skip
    return out


def recovery(
    calls: Sequence[Call], events: Sequence[dict[str, Any]], t0: float, end: float
) -> list[dict[str, Any]]:
    """Each event with ``t_s``, ``recover_s``, ``ready_s``, ``rotation_s`` and its failures."""
    out = []
    for k, e in enumerate(events):
        hi = events[k + 1]["at"] if k + 1 < len(events) else math.inf
        failed = [c for c in calls if e["at"] <= c.end < hi and not c.ok]
        rotation = None
        if e["backend"] and e["ready_at"] is not None:
            back = next(
                (c for c in calls if c.ok and c.backend == e["backend"] and c.end >= e["ready_at"]),
                None,
            )
            rotation = None if back is None else round(back.end - e["ready_at"], 3)
        out.append({
            **{k2: v for k2, v in e.items() if k2 not in ("at", "ready_at")},
            "t_s": _rel(e["at"], t0),
            "ready_s": None if e["ready_at"] is None else round(e["ready_at"] - e["at"], 3),
            "rotation_s": rotation,
            "recover_s": round(max(c.end for c in failed) - e["at"], 3) if failed else 0.0,
            "failures_by_code": dict(sorted(Counter(c.code for c in failed).items())),
        })  # fmt: skip
    return out


def rss_growth(samples: Sequence[tuple[float, int]], warm_from: float) -> dict[str, Any]:
    """A gateway's RSS at its first sample, at ``warm_from`` (or later) and at its last sample."""
    if not samples:
        return {"start_mb": None, "warm_mb": None, "end_mb": None, "growth": None}
    warm = next((s for s in samples if s[0] >= warm_from), None)
    end = samples[-1]
    return {
        "start_mb": round(samples[0][1] / MB, 1),
        "warm_mb": None if warm is None else round(warm[1] / MB, 1),
        "end_mb": round(end[1] / MB, 1),
        "growth": None if warm is None or end[0] <= warm[0] else round(end[1] / warm[1] - 1, 4),
    }


def hedges(counts: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Hedged calls, backend calls and their ratio over the gateways' last scrapes."""
    hedged = sum(c.get("hedges", 0.0) for c in counts)
    calls = sum(c.get("backend_calls", 0.0) for c in counts)
    return {"hedges": int(hedged), "backend_calls": int(calls),
            "ratio": round(hedged / calls, 5) if calls else None}  # fmt: skip


def verdict(report: dict[str, Any], acceptance: dict[str, float]) -> list[str]:
    """Why the run misses the acceptance, one line each ([] = it meets it)."""
    bad = []
    ratio = report["overall"]["success_ratio"]
    if ratio is None or ratio < acceptance["min_success_ratio"]:
        bad.append(f"success ratio {ratio} < {acceptance['min_success_ratio']}")
    for e in report["events"]:
        where = f"event {e['event']} {e['fault']} ({e['component']}, t={e['t_s']} s)"
        if e["error"] or e["ready_s"] is None:
            bad.append(f"{where}: not ready again: {e['error'] or 'timed out'}")
        elif e["backend"] and e["rotation_s"] is None:
            bad.append(f"{where}: ready after {e['ready_s']} s, took no call before the load ended")
        elif e["backend"] and e["rotation_s"] > acceptance["max_rotation_s"]:
            bad.append(f"{where}: back in rotation {e['rotation_s']} s after ready "
                       f"(limit {acceptance['max_rotation_s']} s)")  # fmt: skip
    for name, g in report["gateways"].items():
        if g["growth"] is not None and g["growth"] >= acceptance["max_rss_growth"]:
            bad.append(
                f"gateway {name}: RSS grew {g['growth']:.1%} (limit {acceptance['max_rss_growth']:.0%})"
            )
    h = report.get("hedges") or {}
    limit = acceptance.get("max_hedge_ratio")
    if limit is not None and h.get("ratio") is not None and h["ratio"] > limit:
        bad.append(f"hedges: {h['hedges']} of {h['backend_calls']} TorchServe calls "
                   f"({h['ratio']:.2%}, limit {limit:.0%})")  # fmt: skip
    bad += [f"fault {f} not injected: {why}" for f, why in report["skipped"]]
    return bad


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def table(report: dict[str, Any]) -> str:
    """Events, then phases, then the overall line, as fixed-width text."""
    rows = [f"{'#':>2} {'t s':>6} {'fault':<16} {'target':<10} {'ready s':>7} {'rot s':>6} "
            f"{'recov s':>7}  failures"]  # fmt: skip
    for e in report["events"]:
        codes = ", ".join(f"{k} {v}" for k, v in e["failures_by_code"].items()) or "0"
        rows.append(f"{e['event']:>2} {e['t_s']:>6.1f} {e['fault']:<16} {e['component']:<10} "
                    f"{_ms(e['ready_s']):>7} {_ms(e['rotation_s']):>6} {e['recover_s']:>7g}  "
                    f"{codes}{'  ' + e['error'] if e['error'] else ''}")  # fmt: skip
    rows += [
        "",
        f"{'phase':<22} {'calls':>6} {'fail':>5} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}",
    ]
    for p in report["phases"]:
        span = f"{p['phase']} {p['after'][:10]} {p['from_s']:.0f}-{p['to_s']:.0f}s"
        rows.append(f"{span:<22} {p['requests']:>6} {p['failures']:>5} {_ms(p['p50_ms']):>7} "
                    f"{_ms(p['p99_ms']):>7} {_ms(p['max_ms']):>7}")  # fmt: skip
    o = report["overall"]
    rss = "; ".join(
        f"gateway {k} RSS {_ms(g['warm_mb'])} -> {_ms(g['end_mb'])} MB"
        for k, g in report["gateways"].items()
    )
    h = report.get("hedges") or {}
    if h.get("ratio") is not None:
        rss += f"; hedges {h['hedges']} of {h['backend_calls']} TorchServe calls ({h['ratio']:.2%})"
    rows += ["", f"{o['requests']} calls, {o['failures']} failed "
                 f"({o['failures_by_code'] or 'none'}), success {o['success_ratio']:.4%}; {rss}"]  # fmt: skip
    if report.get("extended_s"):
        rows.append(f"load ran {report['extended_s']:g} s past its duration: slow recoveries "
                    f"pushed the schedule later (max_extension_s)")  # fmt: skip
    return "\n".join(rows)


def plot(calls: Sequence[Call], report: dict[str, Any], t0: float, png: Path, title: str) -> None:
    """Each call's latency over time (colour = replica that answered, x = failed), faults as
    vertical lines, each fault's way back to ready shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5))
    by_backend: dict[str, list[Call]] = {}
    for c in calls:
        by_backend.setdefault(c.backend if c.ok else "failed", []).append(c)
    names = report.get("backends", {})
    for key, group in sorted(by_backend.items()):
        style = {"marker": "x", "s": 25, "color": "red"} if key == "failed" else {"s": 3}
        label = key if key == "failed" else f"replica {names.get(key, key)}"
        ax.scatter(
            [c.end - t0 for c in group], [max(c.ms, 0.1) for c in group], label=label, **style
        )
    for k, e in enumerate(report["events"]):  # labels staggered: faults can be close
        ax.axvline(e["t_s"], color="black", linestyle="--", linewidth=0.8)
        ax.text(e["t_s"], 1.01 + 0.05 * (k % 3), f"{e['fault']} {e['component']}", fontsize=7,
                transform=ax.get_xaxis_transform())  # fmt: skip
        if e["ready_s"]:
            ax.axvspan(e["t_s"], e["t_s"] + e["ready_s"], color="orange", alpha=0.15)
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the load started")
    ax.set_ylabel("latency (ms, log)")
    ax.set_title(title, pad=36)
    ax.legend(loc="upper right", fontsize=8, markerscale=3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
