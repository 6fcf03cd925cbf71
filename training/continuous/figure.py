"""``python -m training.continuous.figure --fresh RUN --frozen RUN2 --out docs/freshness.png``.

Draws the progressive AUC of each file (``RUN/progressive.jsonl``) of a continuous run and of
a run scoring the same files with a model frozen earlier (``continuous.learn=false``), the
oracle AUC where the data has true probabilities, and, from the continuous run's
``continuous.jsonl``, which version the gateway served while each file was scored.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.continuous.file_loop import EVENTS, PROGRESSIVE
from training.metrics.log import read_metrics


def _records(run: Path, name: str) -> list[dict[str, Any]]:
    path = run / name
    return read_metrics(path) if path.is_file() else []


def served_versions(run: Path, files: list[str]) -> list[str | None]:
    """The version serving the default traffic while each of ``files`` was scored: the last
    promoted before it (or the first rollout's ``from``), None before any export."""
    events = _records(run, EVENTS)
    order = [e["file"] for e in events if e["event"] == "file"]
    served: str | None = None
    out: list[str | None] = []
    rollouts = [e for e in events if e["event"] == "rollout"]
    if rollouts and rollouts[0].get("from"):
        served = str(rollouts[0]["from"])
    exported_after = [e.get("after") for e in events if e["event"] == "export"]
    for f in files:
        done_before = set(order[: order.index(f)]) if f in order else set(order)
        if not done_before & set(exported_after):  # nothing exported yet: nothing served
            out.append(None)
            continue
        for r in rollouts:
            if r.get("promoted") and r.get("after") in done_before:
                served = str(r["version"])
        out.append(served)
    return out


def draw(fresh: Path, frozen: Path | None, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = _records(fresh, PROGRESSIVE)
    files = [r["file"] for r in rec]
    x = list(range(len(files)))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(x, [r["auc"] for r in rec], "o-", label=f"continuous ({fresh.name})")
    if frozen is not None:
        stale = {r["file"]: r["auc"] for r in _records(frozen, PROGRESSIVE)}
        xs = [i for i, f in enumerate(files) if f in stale]
        ax.plot(xs, [stale[files[i]] for i in xs], "s--", label=f"frozen ({frozen.name})")
    if all("oracle_auc" in r for r in rec):
        ax.plot(x, [r["oracle_auc"] for r in rec], ":", color="gray", label="oracle (true p)")
    for i, v in enumerate(served_versions(fresh, files)):
        if v is not None:
            ax.annotate(f"v{v}", (i, rec[i]["auc"]), textcoords="offset points", xytext=(0, -14),
                        ha="center", fontsize=8, color="C0")  # fmt: skip
    ax.set_xticks(x, files, rotation=30)
    ax.set_ylabel("progressive AUC (scored before training on the file)")
    ax.set_title("Freshness: each file scored by the model of the files before it")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.continuous.figure", description=__doc__)
    p.add_argument("--fresh", type=Path, required=True, help="the continuous run")
    p.add_argument("--frozen", type=Path, help="a run that scored the same files, frozen")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)
    print(draw(args.fresh, args.frozen, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
