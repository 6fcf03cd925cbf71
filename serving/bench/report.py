"""The benchmark's results: one row per (examples, concurrency, method), with ratios.

``vs plain`` divides by ``plain-torchserve`` at the same cell (examples/s: higher is better;
p50: lower is better); ``efficiency`` = examples/s / ``in-process`` examples/s at the same
request size (in-process runs one caller: the floor's rate on a worker's threads). ``server
CPU ms/req``: CPU time the servers' process groups (gateway; TorchServe's launcher, Java
frontend and workers) spent during the cell's timed calls, per request: where the time goes.
``busy``: the share of the machine's cores (every process) busy during the cell's calls; below
~100% the cell was not CPU-bound, so its examples/s waited on something else.
"""

from __future__ import annotations

from typing import Any

from serving.bench.config import BASELINE, FLOOR
from serving.bench.measure import Cell


def results(cells: list[Cell]) -> list[dict[str, Any]]:
    """Rows for ``--json`` and the table, sorted by examples, concurrency, then method order."""
    rows: list[dict[str, Any]] = [
        {"method": c.method, "examples": c.examples, "concurrency": c.concurrency, **c.figures()}
        for c in cells
    ]
    by = {(r["method"], r["examples"], r["concurrency"]): r for r in rows}
    for r, c in zip(rows, cells, strict=True):
        base = by.get((BASELINE, r["examples"], r["concurrency"]))
        floor = by.get((FLOOR, r["examples"], 1))
        r["examples_per_s_vs_plain"] = _ratio(r["examples_per_s"], base, "examples_per_s")
        r["p50_vs_plain"] = _ratio(r["p50_ms"], base, "p50_ms")
        r["efficiency"] = _ratio(r["examples_per_s"], floor, "examples_per_s")
        r["examples_per_s_rounds"] = [round(x, 1) for x in c.rounds_examples_per_s]
        if c.first_error:
            r["first_error"] = c.first_error
    return rows


def _ratio(value: float, other: dict[str, Any] | None, key: str) -> float | None:
    return value / other[key] if other and other[key] else None


def _cpu(row: dict[str, Any]) -> str:
    """CPU per request: the benchmark's client threads, then each server process group:
    ``client 0.3 | gateway 0.9 + torchserve 2.1``."""
    parts = dict(row.get("cpu_ms_per_request") or {})
    client = parts.pop("client", None)
    servers = " + ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items())) or "-"
    return servers if client is None else f"client {client:.2f} | {servers}"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    """The printed table (and a line per cell with errors)."""
    head = (
        f"{'examples':>8} {'conc':>4}  {'method':<17} {'p50 ms':>8} {'p99 ms':>8} {'examples/s':>11}"
        f" {'req/s':>8} {'ex/s vs plain':>13} {'p50 vs plain':>12} {'efficiency':>10} {'errors':>6}"
        f" {'busy':>5}"
        f"  {'CPU ms/req: client | servers':<24}"
    )
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and (r["examples"], r["concurrency"]) != last:
            lines.append("")
        last = (r["examples"], r["concurrency"])
        lines.append(
            f"{r['examples']:>8} {r['concurrency']:>4}  {r['method']:<17} {r['p50_ms']:>8.2f}"
            f" {r['p99_ms']:>8.2f} {r['examples_per_s']:>11,.0f} {r['requests_per_s']:>8,.1f}"
            f" {_fmt(r['examples_per_s_vs_plain'], '.2f'):>13} {_fmt(r['p50_vs_plain'], '.2f'):>12}"
            f" {_fmt(r['efficiency'], '.2f'):>10} {r['errors']:>6}"
            f" {_fmt(r.get('machine_busy'), '.0%'):>5}  {_cpu(r):<24}"
        )
    for r in rows:
        if r["errors"]:
            lines.append(
                f"{r['method']} at {r['examples']} x {r['concurrency']}: {r['errors']} failed"
                f" calls, first: {r['first_error']}"
            )
    return "\n".join(lines)


def settings_text(settings: dict[str, Any]) -> str:
    """One line per method: where it ran and with which TorchServe settings."""
    lines = [
        f"machine: {settings['cores']} cores ({settings['usable_cores']} usable), load average"
        f" {settings['loadavg_before'][0]:.2f} before, {settings['loadavg_after'][0]:.2f} after;"
        f" model {settings['model']['name']} ({settings['model']['served_variant']})"
    ]
    for method, s in settings["methods"].items():
        lines.append(f"{method}: " + ", ".join(f"{k} {v}" for k, v in s.items()))
    return "\n".join(lines)
