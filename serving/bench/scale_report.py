"""The tables, closing lines and PNG of ``python -m serving.bench.scale`` (its JSON in, no
measuring here).

A "confined" figure is printed only for a run whose memory group hit its limit
(``memory.failcnt`` > 0): one that never filled measured an unconfined replica under another
name, and its row says so instead, with its peak against its limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

GB, MIB = 2**30, 2**20


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / MIB:.0f}"


def table(results: list[dict[str, Any]]) -> str:
    """One line per size: the export's cost, the replica's memory, the unconfined load."""
    head = ("rows", "fp32 GB", "export s (tables/parity/archive)", "peak RSS", "disk GB",
            "ready s", "SERVING s", "PSS/worker", "total PSS", "working set MiB",
            "group peak MiB", "ex/s", "p99 ms", "faults/1k", "failed")  # fmt: skip
    lines = [" | ".join(head)]
    for r in results:
        s, t = r["serve"], r["export_timings"]
        parts = "/".join(f"{t.get(k, 0):.0f}" for k in ("variants_s", "parity_s", "archive_s"))
        lines.append(" | ".join([
            f"{r['rows'] / 1e6:.1f}M", f"{r['fp32_table_bytes'] / GB:.2f}",
            f"{r['export_s']:.0f} ({parts})", f"{r['export_peak_rss'] / GB:.2f}",
            f"{r['disk_bytes'] / GB:.2f}", f"{s['ready_s']:.0f}", f"{s['serving_s']:.0f}",
            "/".join(f"{w / GB:.2f}" for w in s["worker_pss"]), f"{s['total_pss'] / GB:.2f}",
            _mib(s["working_set_bytes"]), _mib(s.get("peak_bytes")),
            f"{s['examples_per_s']:,.0f}", f"{s['p99_ms']:.0f}",
            f"{s['major_faults_per_1k_lookups']:.2f}", f"{s['failed']}",
        ]))  # fmt: skip
    return "\n".join(lines)


def confined_row(r: dict[str, Any], c: dict[str, Any]) -> str:
    """One confined run against the unconfined one; a refusal when it confined nothing."""
    s = r["serve"]
    lead = [f"{r['rows'] / 1e6:.1f}M", f"{c.get('fraction', 0):.0%} "
            f"({c.get('fraction', 0) * r['int8_table_bytes'] / MIB:.0f} MiB)"]  # fmt: skip
    if "skipped" in c:
        return " | ".join([*lead, f"not run: {c['skipped']}"])
    lead += [_mib(c["limit_bytes"]), _mib(c["peak_bytes"]), f"{c['failcnt']:,}"]
    if not c["filled"]:
        return " | ".join([*lead, "NOT CONFINED: the group never reached its limit "
                           "(failcnt 0); no confined figures"])  # fmt: skip
    ratio = c["examples_per_s"] / s["examples_per_s"]
    return " | ".join([
        *lead, f"{s['major_faults_per_1k_lookups']:.2f} / {c['major_faults_per_1k_lookups']:.2f}",
        f"{s['examples_per_s']:,.0f} / {c['examples_per_s']:,.0f} ({ratio:.0%})",
        f"{s['p99_ms']:.0f} / {c['p99_ms']:.0f}", f"{c['failed']}",
    ])  # fmt: skip


def confined_table(results: list[dict[str, Any]]) -> str:
    """Each confined run (``--fractions``): its group's limit, peak and fail count, then the
    figures against the unconfined run, or why there are none."""
    head = ("rows", "int8 tables allowed", "limit MiB", "peak MiB", "failcnt",
            "faults/1k (unconfined / confined)", "ex/s (unconfined / confined)",
            "p99 ms", "failed")  # fmt: skip
    lines = [" | ".join(head)]
    for r in results:
        runs = r.get("sweep") or ([r["confined"]] if "confined" in r else [])
        lines += [confined_row(r, c) for c in runs]
    return "\n".join(lines)


def variants_table(results: list[dict[str, Any]]) -> str:
    """int8 and each other variant (``--variants``) side by side: table bytes, |ΔAUC| vs the
    parity reference, examples/s and faults unconfined, and confined to the same limit (only
    where that group filled)."""
    head = ("rows", "variant", "tables MiB", "|ΔAUC|", "ex/s unconfined", "faults/1k",
            "confined limit MiB", "confined ex/s", "confined faults/1k", "failed")  # fmt: skip
    lines = [" | ".join(head)]
    for r in results:
        first = {"variant": "int8", "table_bytes": r["int8_table_bytes"], "serve": r["serve"],
                 "confined": r.get("confined", {}),
                 "abs_delta_auc": next((v["int8_abs_delta_auc"] for v in r.get("variants", [])),
                                       None)}  # fmt: skip
        for v in [first, *r.get("variants", [])]:
            s, c = v["serve"], v.get("confined") or {}
            full = c.get("filled", False)
            ratio = s["examples_per_s"] / r["serve"]["examples_per_s"]
            lines.append(" | ".join([
                f"{r['rows'] / 1e6:.1f}M", v["variant"], _mib(v["table_bytes"]),
                "-" if v["abs_delta_auc"] is None else f"{v['abs_delta_auc']:.1e}",
                f"{s['examples_per_s']:,.0f} ({ratio:.0%} of int8)",
                f"{s['major_faults_per_1k_lookups']:.2f}", _mib(c.get("limit_bytes")),
                f"{c['examples_per_s']:,.0f}" if full
                else "not run" if "skipped" in c else "not confined" if c else "-",
                f"{c['major_faults_per_1k_lookups']:.2f}" if full else "-",
                f"{s['failed']}/{c.get('failed', '-')}",
            ]))  # fmt: skip
    return "\n".join(lines)


def closing(r: dict[str, Any]) -> str:
    """The size's confined against unconfined, in a sentence, as measured."""
    s, c = r["serve"], r.get("confined", {})
    size = f"{r['rows'] / 1e6:.1f}M rows"
    if not c or "skipped" in c:
        return f"{size}: no confined run ({c.get('skipped', 'confine off')})"
    if not c["filled"]:
        return (f"{size}: the confined group never filled (peak {_mib(c['peak_bytes'])} of "
                f"{_mib(c['limit_bytes'])} MiB): no confined figure")  # fmt: skip
    return (
        f"{size}: confined to {c['fraction']:.0%} of the int8 tables (limit "
        f"{_mib(c['limit_bytes'])} MiB, peak {_mib(c['peak_bytes'])} MiB, hit {c['failcnt']:,} "
        f"times; working set {_mib(c['working_set_bytes'])} MiB), "
        f"{c['examples_per_s']:,.0f} vs {s['examples_per_s']:,.0f} examples/s unconfined "
        f"({c['examples_per_s'] / s['examples_per_s']:.0%}), "
        f"{c['major_faults_per_1k_lookups']:.1f} vs {s['major_faults_per_1k_lookups']:.1f} "
        f"major faults per 1,000 lookups, p99 {c['p99_ms']:.0f} vs {s['p99_ms']:.0f} ms, "
        f"{c['failed']} failed"
    )


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Cost vs table size (export RSS, disk, replica PSS), and examples/s unconfined and
    confined (only where the group filled)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    x = [r["fp32_table_bytes"] / GB for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (
        ("export_peak_rss", "export peak RSS"),
        ("disk_bytes", "export + .mar on disk"),
    ):
        a.plot(x, [r[key] / GB for r in results], "o-", label=label)
    a.plot(x, [r["serve"]["total_pss"] / GB for r in results], "o-",
           label="replica PSS (all workers)")  # fmt: skip
    a.plot(x, x, "k:", label="fp32 tables")
    a.set(xlabel="fp32 table GiB", ylabel="GiB", title="cost vs table size")
    a.legend()
    b.plot(x, [r["serve"]["examples_per_s"] for r in results], "o-", label="unconfined")
    confined = [r.get("confined", {}) for r in results]
    b.plot(x, [c["examples_per_s"] if c.get("filled") else np.nan for c in confined], "o-",
           label="confined (group full)")  # fmt: skip
    b.set(xlabel="fp32 table GiB", ylabel="examples/s", title="serving through the gateway (Zipf)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
