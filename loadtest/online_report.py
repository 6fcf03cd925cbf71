"""The online demo's figures (``make demo-online``, :mod:`loadtest.online_demo`), from what each
part wrote: the gateway's impression and click logs (:mod:`recsys_stack.online`), the joiner's
files and manifest, the continuous loop's ``continuous.jsonl`` and the simulator's summary.

- **Accounting**, exact: the joined rows are compared with an independent join done here in
  Python over the same logs (a click with label 1 in ``[impression, impression + W]`` -> 1,
  else 0), as multisets of ``(label, row)``: ``lost`` = expected and not written, ``doubled`` =
  written more often than expected, ``mislabelled`` = written with the other label. Impressions
  whose window had not closed when the joiner stopped are left out of both sides (they are
  the next run's). Then rows in the loop's folder = rows trained + carried (the ledger).
- **Click-to-served freshness**: per click with label 1 that became a joined row, from its event
  time to ``acked_at`` of the first promoted delta trained on the file holding it (every worker
  serving those weights); p50 / p95 / max.
- **Progressive AUC**: the simulator's buckets (served vs frozen vs the planted model).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from recsys_stack.online import CLICKS, IMPRESSIONS, SUFFIX


def records(folder: Path) -> Iterator[dict[str, Any]]:
    """Every record of the closed log files of ``folder`` (hidden open files are skipped)."""
    for path in sorted(folder.glob(f"*{SUFFIX}")):
        with path.open() as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def expected_rows(
    log_dir: Path, window_s: float, closed_before_ms: int
) -> tuple[Counter[str], dict[str, int]]:
    """The joined rows the logs call for (``label\\trow`` -> count), impressions whose window
    closed before ``closed_before_ms`` only; and counts: impressions logged, unwritable, open."""
    clicked: dict[tuple[str, int], list[int]] = {}
    for c in records(log_dir / CLICKS):
        if int(c["label"]) == 1:
            clicked.setdefault((c["request_id"], int(c["example"])), []).append(
                int(c["event_time_ms"])
            )
    want: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    w = int(window_s * 1000)
    for i in records(log_dir / IMPRESSIONS):
        counts["impressions"] += 1
        t = int(i["event_time_ms"])
        if i.get("row") is None:
            counts["unwritable"] += 1
            continue
        if t + w >= closed_before_ms:
            counts["window_open"] += 1
            continue
        times = clicked.get((i["request_id"], int(i["example"])), [])
        label = int(any(t <= ct <= t + w for ct in times))
        want[f"{label}\t{i['row']}"] += 1
    return want, dict(counts)


def joined_rows(files: Iterable[Path], staged: Iterable[Path] = ()) -> tuple[Counter[str], int]:
    """The rows (``label\trow`` -> count) of the joined ``files`` and of the joiner's committed
    ``staged`` parts (lines ``<click ms>\t<label>\t<row>``: rows waiting for a file of
    ``--min-rows``); and how many were staged."""
    rows: Counter[str] = Counter()
    for path in files:
        with path.open() as f:
            rows.update(line.rstrip("\n") for line in f if line.strip())
    waiting: Counter[str] = Counter()
    for path in staged:
        with path.open() as f:
            waiting.update(line.rstrip("\n").partition("\t")[2] for line in f if line.strip())
    return rows + waiting, sum(waiting.values())


def accounting(want: Counter[str], got: Counter[str]) -> dict[str, int]:
    """``lost``, ``doubled`` and ``mislabelled`` rows of ``got`` against ``want`` (module doc);
    rows of ``got`` not in ``want`` at all are ``unexpected`` (an impression still open, or a
    row nobody logged)."""

    def unlabelled(c: Counter[str]) -> Counter[str]:
        out: Counter[str] = Counter()
        for row, n in c.items():
            out[row.partition("\t")[2]] += n
        return out

    rows_want, rows_got = unlabelled(want), unlabelled(got)
    lost = sum((rows_want - rows_got).values())
    extra = rows_got - rows_want
    doubled = sum(n for r, n in extra.items() if r in rows_want)
    return {"expected": sum(want.values()), "joined": sum(got.values()), "lost": lost,
            "doubled": doubled, "unexpected": sum(extra.values()) - doubled,
            "mislabelled": sum((want - got).values()) - lost}  # fmt: skip


def freshness(manifest: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, Any]:
    """Click-to-served seconds (module doc) from the joiner's manifest (per file: ``name``,
    ``click_event_ms``) and the loop's events (``file`` in order, promoted ``delta`` with
    ``after`` and ``acked_at``)."""
    order = {e["file"]: k for k, e in enumerate(x for x in events if x["event"] == "file")}
    served = sorted((order[d["after"]], float(d["acked_at"])) for d in events
                    if d["event"] == "delta" and d.get("promoted") and d.get("acked_at")
                    and d.get("after") in order)  # fmt: skip
    seconds, unserved = [], 0
    for m in manifest:
        k = order.get(m["name"])
        at = next((t for j, t in served if k is not None and j >= k), None)
        for ct in m.get("click_event_ms", []):
            if at is None:
                unserved += 1
            else:
                seconds.append(at - ct / 1000.0)
    if not seconds:
        return {"clicks": 0, "unserved": unserved}
    seconds.sort()
    return {"clicks": len(seconds), "unserved": unserved,
            "p50_s": round(statistics.median(seconds), 1),
            "p95_s": round(seconds[min(len(seconds) - 1, int(0.95 * len(seconds)))], 1),
            "max_s": round(seconds[-1], 1)}  # fmt: skip


def loop_rows(events: list[dict[str, Any]], names: set[str]) -> dict[str, int]:
    """Rows of the files ``names`` the loop took: in the files, trained, carried to the next."""
    files = [e for e in events if e["event"] == "file" and e["file"] in names]
    return {"files": len(files), "rows": sum(e["rows"] for e in files),
            "trained": sum(e["trained_rows"] for e in files),
            "carried_in_first": files[0]["carried_in"] if files else 0,
            "carried_out_last": files[-1]["carried_out"] if files else 0}  # fmt: skip


def table(r: dict[str, Any]) -> str:
    """The figures as a few lines for the terminal and docs."""
    a, f, s = r["accounting"], r["freshness"], r["sim"]
    auc = [b for b in s.get("buckets", []) if "auc_served" in b]
    lines = [
        f"impressions logged {r['logs']['impressions']:,} (unwritable {r['logs'].get('unwritable', 0)},"
        f" window still open {r['logs'].get('window_open', 0)}); joined {a['joined']:,} of "
        f"{a['expected']:,} expected: lost {a['lost']}, doubled {a['doubled']}, mislabelled "
        f"{a['mislabelled']}, unexpected {a['unexpected']}",
        f"loop: {r['loop']['files']} joined files, {r['loop']['rows']:,} rows, trained "
        f"{r['loop']['trained']:,}, carried to the next {r['loop']['carried_out_last']}",
        f"click-to-served: p50 {f.get('p50_s')} s, p95 {f.get('p95_s')} s, max {f.get('max_s')} s "
        f"over {f['clicks']:,} clicks ({f['unserved']} not served yet)",
        f"scoring calls {s.get('calls')}, feedback calls {s.get('feedback_calls')}",
    ]
    for b in auc:
        lines.append(f"  t={b['t_s']:>5.0f}s day {b['day']}: AUC served {b['auc_served']:.4f} "
                     f"frozen {b.get('auc_frozen', float('nan')):.4f} planted "
                     f"{b['auc_planted']:.4f} ({b.get('served_vs_frozen', '')})")  # fmt: skip
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> Path:
    """The progressive AUC of the served, frozen and planted models over the run, and the
    click-to-served figures in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    buckets = [b for b in r["sim"].get("buckets", []) if "auc_served" in b]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    t = [b["t_s"] / 60 for b in buckets]
    for key, label, style in (("auc_planted", "planted model (the best any model can do)", ":"),
                              ("auc_served", "served (trained on the joined clicks)", "-"),
                              ("auc_frozen", "frozen at the start", "--")):  # fmt: skip
        ax.plot(t, [b.get(key) for b in buckets], style, marker="o", ms=3, label=label)
    for b in buckets[1:]:
        if b["day"] != buckets[buckets.index(b) - 1]["day"]:
            ax.axvline(b["t_s"] / 60, color="grey", lw=0.5)
    f = r["freshness"]
    ax.set(xlabel="minutes (grey: the world drifts a synthetic day)", ylabel="AUC on the traffic",
           title=f"closed loop: click-to-served p50 {f.get('p50_s')} s, p95 {f.get('p95_s')} s; "
                 f"{r['accounting']['lost']} lost, {r['accounting']['doubled']} doubled")  # fmt: skip
    ax.legend(loc="lower left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
