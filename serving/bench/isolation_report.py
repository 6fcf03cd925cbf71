"""The isolation bench's figures: per row, against the legitimate client alone, and the targets.

Targets (issue 45): the legitimate client's success >= 99.9% beside every abuser, its p99 at
most 2x its p99 alone, the gateway's log growing < 2 MB over the whole run, its RSS at the end
at most 1.5x its RSS at the start.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

SUCCESS_PCT = 99.9
P99_RATIO = 2.0
LOG_BYTES = 2_000_000
RSS_RATIO = 1.5


def legit_figures(out: dict[str, Any]) -> dict[str, Any]:
    """The legitimate client's calls, success %, p50/p99 of its successful calls."""
    ms = np.asarray(out.get("ok_ms") or [math.nan])
    calls = int(out["calls"])
    ok = int(out["codes"].get("OK", 0))
    return {
        "calls": calls,
        "ok": ok,
        "success_pct": 100.0 * ok / calls if calls else 0.0,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "codes": out["codes"],
        "first_errors": out.get("first_errors", {}),
        "cpu_s": out.get("cpu_s"),
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's ``p99_ratio``: its p99 over the ``alone`` row's (None without one)."""
    alone = next((r["legit"]["p99_ms"] for r in rows if r["row"] == "alone"), None)
    for r in rows:
        p99 = r["legit"]["p99_ms"]
        ok = alone and not math.isnan(alone) and not math.isnan(p99)
        r["p99_ratio"] = p99 / alone if ok and alone else None


def verdicts(result: dict[str, Any]) -> list[str]:
    """One line per target: met or not, with the figure."""
    rows, run = result["rows"], result["run"]
    lines = []
    worst = min(rows, key=lambda r: r["legit"]["success_pct"])
    lines.append(_verdict(
        worst["legit"]["success_pct"] >= SUCCESS_PCT,
        f"legitimate success >= {SUCCESS_PCT}% in every row (worst {worst['row']}: "
        f"{worst['legit']['success_pct']:.2f}%)",
    ))  # fmt: skip
    ratios = [r for r in rows if r.get("p99_ratio") is not None]
    if ratios:
        top = max(ratios, key=lambda r: r["p99_ratio"])
        lines.append(_verdict(
            top["p99_ratio"] <= P99_RATIO,
            f"p99 <= {P99_RATIO:g}x alone in every row (worst {top['row']}: "
            f"{top['p99_ratio']:.2f}x)",
        ))  # fmt: skip
    lines.append(_verdict(
        run["log_growth_bytes"] < LOG_BYTES,
        f"gateway log growth < {LOG_BYTES / 1e6:g} MB over the run ({_bytes(run['log_growth_bytes'])})",
    ))  # fmt: skip
    ratio = run["rss_end"] / run["rss_start"] if run["rss_start"] else math.inf
    lines.append(_verdict(
        ratio <= RSS_RATIO,
        f"gateway RSS end <= {RSS_RATIO:g}x start ({_bytes(run['rss_start'])} -> "
        f"{_bytes(run['rss_end'])}: {ratio:.2f}x)",
    ))  # fmt: skip
    if run.get("gateway_exit") is not None:
        lines.append(f"FAIL  the gateway exited with code {run['gateway_exit']} during the run")
    return lines


def _verdict(ok: bool, text: str) -> str:
    return f"{'ok  ' if ok else 'FAIL'}  {text}"


def _bytes(n: float) -> str:
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1f}"


def _codes(codes: dict[str, int], top: int = 3) -> str:
    """The ``top`` most frequent outcomes, ``CODE n``."""
    best = sorted(codes.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{k} {v:,}" for k, v in best[:top])
    return text + (f", +{len(best) - top} more" if len(best) > top else "")


def cells(r: dict[str, Any]) -> list[str]:
    """One row's cells, in :data:`HEADER`'s order."""
    legit, ab = r["legit"], r.get("abuser") or {}
    ratio = r.get("p99_ratio")
    abuser = ab.get("label", "-")
    extra = f" (peak open {ab['peak_open']:,})" if "peak_open" in ab else ""
    return [
        r["row"], abuser, f"{legit['calls']:,}", f"{legit['success_pct']:.2f}",
        _ms(legit["p50_ms"]), _ms(legit["p99_ms"]),
        "-" if ratio is None else f"{ratio:.2f}x",
        f"{ab['calls']:,}" if ab else "-", (_codes(ab["codes"]) + extra) if ab else "-",
        _bytes(r["log_growth_bytes"]), f"{r['gateway_cpu_s']:.1f}", _bytes(r["gateway_rss"]),
        f"{r['loadavg'][0]:.1f}",
    ]  # fmt: skip


HEADER = ["row", "abuser", "legit calls", "success %", "p50 ms", "p99 ms", "p99/alone",
          "abuser calls", "abuser outcomes", "log growth", "gw cpu s", "gw rss", "load 1m"]  # fmt: skip


def summary(result: dict[str, Any]) -> str:
    """The lines under the tables: the run's log, RSS and load."""
    run, s = result["run"], result["settings"]
    return (
        f"gateway log: +{_bytes(run['log_growth_bytes'])} over the rows "
        f"({_bytes(run['log_bytes_end'])} in all); gateway RSS {_bytes(run['rss_start'])} at "
        f"start -> {_bytes(run['rss_end'])} at end; its open-files limit (soft, hard) "
        f"{tuple(s['gateway_nofile'])}; load average "
        f"{'/'.join(f'{x:.1f}' for x in s['loadavg_before'])} before, "
        f"{'/'.join(f'{x:.1f}' for x in s['loadavg_after'])} after "
        f"({s['usable_cores']} usable cores)"
    )


def table(result: dict[str, Any]) -> str:
    """The rows as a fixed-width table, the run's summary and the verdicts."""
    body = [HEADER, *(cells(r) for r in result["rows"])]
    widths = [max(len(row[i]) for row in body) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([*lines, "", summary(result), *verdicts(result)])


def markdown(result: dict[str, Any]) -> str:
    """The rows as a markdown table (docs/bench.md), the summary and the verdicts."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in result["rows"]]
    return "\n".join([*lines, "", summary(result), "", *(f"- {v}" for v in verdicts(result))])


def row_line(i: int, n: int, r: dict[str, Any]) -> str:
    """The progress line of row ``i`` of ``n``, printed as it ends."""
    legit, ab = r["legit"], r.get("abuser") or {}
    return (
        f"[{i}/{n}] {r['row']}: legit {legit['calls']:,} calls, {legit['success_pct']:.2f}% ok, "
        f"p50 {_ms(legit['p50_ms'])} / p99 {_ms(legit['p99_ms'])} ms"
        + (f"; abuser {ab['calls']:,} calls ({_codes(ab['codes'])})" if ab else "")
        + f"; log +{_bytes(r['log_growth_bytes'])}; load {r['loadavg'][0]:.1f}"
    )
