"""The text table and the PNG of ``python -m training.bench.scale`` (its JSON result in, no
measuring here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NOISY = 0.10  # warn when other processes took more than this share of the machine's CPU


def busy(runs: list[dict[str, Any]], cpus: int) -> float:
    """Share of the machine's CPU that other processes used during ``runs``."""
    return sum(r["others_cpu_s"] for r in runs) / max(cpus * sum(r["seconds"] for r in runs), 1e-9)


def table(result: dict[str, Any]) -> str:
    """The figures as text: one line per measurement, with the share of the machine that other
    processes used meanwhile, and a warning when that share makes the figure unreliable."""
    lines, cpus, noisy = [], result["setup"]["cpus"], []
    if pre := result.get("preprocess"):
        for kind in ("single", "parallel"):
            k, share = pre[kind], busy(pre[kind]["runs"], cpus)
            noisy += [f"preprocess {kind}"] if share > NOISY else []
            lines.append(f"preprocess {kind:<8} {k['processes_used']} process(es): "
                         f"{k['rows_per_sec']:>12,.0f} rows/s (others: {share:.0%} CPU)"
                         )  # fmt: skip
        rounds = ", ".join(f"{x:.2f}" for x in pre["round_speedups"])
        lines.append(f"preprocess speedup: {pre['speedup']:.2f}x (rounds {rounds}); caches "
                     f"byte-identical: {pre['identical']}")  # fmt: skip
    if cache := result.get("cache"):
        lines.append(f"cache: {cache['bytes_per_row']:.1f} bytes/row on disk "
                     f"({cache['bytes_per_row_without_prob']:.1f} without prob.npy)")  # fmt: skip
    if train := result.get("train"):
        for name in result["setup"]["topologies"]:
            t, share = train[name], busy([train[name]], cpus)
            noisy += [f"train {name}"] if share > NOISY else []
            lines.append(f"train {name} ({t['nodes']} node(s) x {t['ranks_per_node']} rank(s)): "
                         f"{t['samples_per_sec']:>10,.0f} samples/s, windows "
                         + ", ".join(f"{w:,.0f}" for w in t["windows"])
                         + f"; peak RSS {t['peak_rss'] / 2**30:.2f} GiB"
                         + f" (others: {share:.0%} CPU)")  # fmt: skip
        lines += [f"train {k}: {v:.2f}" for k, v in train["ratios"].items()]
    if noisy:
        lines.append(f"warning: other processes used over {NOISY:.0%} of the CPU during "
                     f"{', '.join(noisy)}: rerun on a quiet machine")  # fmt: skip
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Bars: preprocessing rows/s (1 vs N processes), training samples/s per topology."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    panels = [("preprocess", "rows/s"), ("train", "samples/s")]
    panels = [(k, unit) for k, unit in panels if k in result]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.5), squeeze=False)
    for ax, (key, unit) in zip(axes[0], panels, strict=True):
        if key == "preprocess":
            names = [f"{result[key][k]['processes_used']} proc." for k in ("single", "parallel")]
            values = [result[key][k]["rows_per_sec"] for k in ("single", "parallel")]
        else:
            names = list(result["setup"]["topologies"])
            values = [result[key][n]["samples_per_sec"] for n in names]
            names = [n.replace("x", " node(s) x ") + " rank(s)" for n in names]
        ax.bar(names, values)
        ax.set(ylabel=unit, title=f"{key} ({result['setup']['rows'] / 1e6:g}M rows)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
