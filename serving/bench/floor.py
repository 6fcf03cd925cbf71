"""``python -m serving.bench.floor BENCH.json [--baseline OLD.json]``: how close to the compute floor.

Reads what ``python -m serving.bench --json`` wrote and prints, per cell, the floor (the
in-process forward's examples/s at that request size times the workers the stack runs, each
on its share of the cores: what the hardware does with no serving at all), TorchServe's gRPC
API called directly, the gateway in front of TorchServe and the gateway in front of the lite
workers (serving/lite), each as examples/s and as a share of the floor, the gateways against
TorchServe direct, and the CPU each spends per request (client threads and servers). Then
issue 51's targets, each met or missed, for each gateway:

- examples/s >= TorchServe gRPC direct in every cell;
- >= 0.8 of the floor at 1,000 examples and >= 0.6 at 100 examples with 4 or more callers (one
  caller keeps one worker busy: half the floor at most), >= 0.3
  at 1 example and 64 callers;
- p50 at one caller no worse than the gateway's + 0.3 ms: ``--baseline``'s (an earlier run's
  JSON), else this run's gateway in front of TorchServe.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from serving.bench.config import FLOOR, LITE

DIRECT = "torchserve-grpc"
GATEWAYS = ("gateway", LITE)
SHARE_TARGETS = {  # (examples, least concurrency) -> least share of the floor
    (1000, 4): 0.8,
    (100, 4): 0.6,
    (1, 64): 0.3,
}
P50_SLACK_MS = 0.3


def _rows(doc: dict[str, Any]) -> dict[tuple[str, int, int], dict[str, Any]]:
    return {(r["method"], r["examples"], r["concurrency"]): r for r in doc["results"]}


def floor_of(doc: dict[str, Any], examples: int) -> float | None:
    """The floor's examples/s at ``examples`` per request: the in-process forward (one caller,
    a worker's threads) times the stack's TorchServe workers."""
    row = _rows(doc).get((FLOOR, examples, 1))
    workers = doc["settings"]["methods"].get(DIRECT, {}).get("workers") or 1
    return row["examples_per_s"] * workers if row else None


def target_share(examples: int, concurrency: int) -> float | None:
    """Issue 51's least share of the floor for a cell, None where it sets none."""
    for (n, least), share in SHARE_TARGETS.items():
        if examples == n and concurrency >= least:
            return share
    return None


def _cpu(row: dict[str, Any] | None) -> str:
    parts = dict((row or {}).get("cpu_ms_per_request") or {})
    return f"{sum(parts.values()):.2f}" if parts else "-"


def report(doc: dict[str, Any], baseline: dict[str, Any] | None = None) -> tuple[str, list[str]]:
    """The table and the list of missed targets (empty: all met)."""
    rows = _rows(doc)
    cells = sorted({(n, c) for (m, n, c) in rows if m != FLOOR})
    present = [g for g in GATEWAYS if any(m == g for m, _, _ in rows)]
    head = f"{'examples':>8} {'conc':>4} {'floor':>9} {'TS direct':>10}"
    for g in present:
        head += f" {g:>13} {'/floor':>6} {'/TS':>5}"
    head += "  CPU ms/req: TS direct" + "".join(f" | {g}" for g in present)
    lines, missed = [head, "-" * len(head)], []
    for n, c in cells:
        floor, direct = floor_of(doc, n), rows.get((DIRECT, n, c))
        line = f"{n:>8,} {c:>4} {floor or 0:>9,.0f} {direct['examples_per_s'] if direct else 0:>10,.0f}"
        cpus = [_cpu(direct)]
        for g in present:
            r = rows.get((g, n, c))
            if r is None:
                line += f" {'-':>13} {'-':>6} {'-':>5}"
                continue
            share = r["examples_per_s"] / floor if floor else None
            vs = r["examples_per_s"] / direct["examples_per_s"] if direct else None
            line += f" {r['examples_per_s']:>13,.0f} {share or 0:>6.2f} {vs or 0:>5.2f}"
            cpus.append(_cpu(r))
            if vs is not None and vs < 1:
                missed.append(f"{g} {n} x {c}: {vs:.2f}x TorchServe direct (target >= 1)")
            want = target_share(n, c)
            if want is not None and share is not None and share < want:
                missed.append(f"{g} {n} x {c}: {share:.2f} of the floor (target >= {want})")
        lines.append(line + "  " + " | ".join(cpus))
    lines.append("")
    old = _rows(baseline or doc)  # "today's" p50: the baseline run's gateway, else this run's
    for g in present:
        for n, c in cells:
            if c != 1 or (g, n, 1) not in rows or ("gateway", n, 1) not in old:
                continue
            if g == "gateway" and baseline is None:
                continue
            now, then = rows[(g, n, 1)]["p50_ms"], old[("gateway", n, 1)]["p50_ms"]
            lines.append(f"p50 at 1 caller, {n:,} examples: {g} {now:.2f} ms, "
                         f"{'baseline' if baseline else 'this run'}'s gateway {then:.2f} ms")  # fmt: skip
            if now > then + P50_SLACK_MS:
                missed.append(f"{g} p50 at {n} x 1: {now:.2f} ms > {then:.2f} + 0.3 ms")
    s = doc["settings"]
    load = f"load average {s['loadavg_before'][0]:.2f} before, {s['loadavg_after'][0]:.2f} after"
    lines.insert(0, f"{s['date']}, {s['cores']} cores, {load}, model {s['model']['name']}")
    return "\n".join(lines), missed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m serving.bench.floor",
        description="How close a python -m serving.bench run is to the compute floor, each "
        "gateway against TorchServe called directly, and issue 51's targets met or missed "
        "(exit 1 naming each miss).",
    )
    p.add_argument("bench", type=Path, help="the JSON of python -m serving.bench --json FILE")
    p.add_argument("--baseline", type=Path, help="an earlier run's JSON: the p50 to hold")
    args = p.parse_args(argv)
    try:
        doc = json.loads(args.bench.read_text())
        base = json.loads(args.baseline.read_text()) if args.baseline else None
    except (OSError, ValueError) as e:
        print(f"error: {e}: give the file python -m serving.bench --json wrote", file=sys.stderr)
        return 2
    text, missed = report(doc, base)
    print(text)
    print()
    print("targets: all met" if not missed else "targets missed:\n  " + "\n  ".join(missed))
    return 0 if not missed else 1


if __name__ == "__main__":
    sys.exit(main())
