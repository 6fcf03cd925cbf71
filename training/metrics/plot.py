"""Plot a run's learning curves: ``python -m training.metrics.plot runs/demo`` ->
``runs/demo/curves.png``.

Left: training loss per logged step. Right: the validation AUC of every evaluation against the
oracle AUC (the Bayes limit, synthetic data only) and its NE, the final test AUC (the report:
rows no decision saw) and the linear baseline's on the same test rows (when it was fitted).
A short run's few points are drawn as markers (one logged step is a line of no length).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from training.metrics.log import read_metrics

FEW = 30  # logged steps under which each is drawn as a marker


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the PNG and return its path."""
    import matplotlib.pyplot as plt

    fig = figure(run_dir)
    out = out or run_dir / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def figure(run_dir: Path) -> Any:
    """The matplotlib figure of :func:`plot_run` (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = (
        read_metrics(run_dir / "train_loss.jsonl")
        if (run_dir / "train_loss.jsonl").is_file()
        else []
    )
    evals = read_metrics(run_dir / "metrics.jsonl")
    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(11, 4))
    few = "o-" if len(losses) < FEW else "-"
    ax_loss.plot([r["step"] for r in losses], [r["loss"] for r in losses], few, lw=1, ms=3)
    ax_loss.set(title="training loss (BCE)", xlabel="step", ylabel="loss")
    ax_loss.grid(alpha=0.3)
    steps = [r["step"] for r in evals]
    valid = [r.get("valid") or r for r in evals]  # a final record's validation figures
    ax_auc.plot(steps, [v["auc"] for v in valid], "o-", label="validation AUC")
    if all("oracle_auc" in v for v in valid) and evals:
        ax_auc.plot(steps, [v["oracle_auc"] for v in valid], "--", label="oracle AUC (Bayes limit)")
    test = [r for r in evals if r.get("split") == "test"]
    if test:
        ax_auc.plot([r["step"] for r in test], [r["auc"] for r in test], "*", ms=12, color="C2",
                    label="test AUC (the report)")  # fmt: skip
    baseline = [r["baseline_auc"] for r in evals if "baseline_auc" in r]
    if baseline:
        ax_auc.axhline(baseline[-1], ls="-.", color="C3", label="linear baseline AUC (test)")
    ax_auc.set(title="evaluation", xlabel="step", ylabel="AUC")
    ax_ne = ax_auc.twinx()
    ax_ne.plot(steps, [v["ne"] for v in valid], "s:", color="gray", label="validation NE")
    ax_ne.set_ylabel("normalized entropy")
    lines = ax_auc.get_legend_handles_labels()
    ne_lines = ax_ne.get_legend_handles_labels()
    ax_auc.legend(lines[0] + ne_lines[0], lines[1] + ne_lines[1], loc="lower right")
    ax_auc.grid(alpha=0.3)
    fig.suptitle(f"{run_dir}")
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.metrics.plot", description=__doc__)
    p.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    p.add_argument("--out", type=Path, help="PNG path (default: <run_dir>/curves.png)")
    ns = p.parse_args(argv)
    if not (ns.run_dir / "metrics.jsonl").is_file():
        print(f"error: {ns.run_dir / 'metrics.jsonl'} not found: train first", file=sys.stderr)
        return 2
    print(plot_run(ns.run_dir, ns.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
