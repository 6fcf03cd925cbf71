"""What a sweep leaves: ``report.md`` (a table of trials, the best, against the preset's own
config), ``trials.png`` (the validation AUC of each trial and the best so far; each trial's
curve, the pruned ones cut short), ``summary.json`` and ``best.toml``.

Every AUC carries its 95% DeLong interval (the training run's ``auc_ci``). The best trial is
chosen on validation rows, so its validation AUC is optimistic (the maximum of noisy figures):
when the trainer evaluates a test split, the report gives the chosen trial's test AUC, on rows
no decision saw. Best against default is an unpaired test of the two intervals (the runs keep
no scores to pair them): conservative, since both are scored on the same rows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from recsys_model.atomic import write_atomic
from recsys_stack.auc_stats import Z95
from training.sweep.best import write_best
from training.sweep.options import SweepArgs
from training.sweep.trial import on_test, read_records, valid_records


def rows(study: Any) -> list[dict[str, Any]]:
    """One dict per trial: number, state, value (dict), params, seconds, note, default."""
    out = []
    for t in study.get_trials(deepcopy=False):
        a = t.user_attrs
        value = a.get("value")
        if value is None and t.intermediate_values:  # pruned: its last evaluation
            value = {"auc": t.intermediate_values[max(t.intermediate_values)]}
        note = a.get("pruned") or a.get("failed") or ""
        if t.state.name == "FAIL" and "failed" not in a:
            note = "interrupted (not counted)"
        out.append({"number": t.number, "state": t.state.name.lower(), "value": value,
                    "params": dict(t.params), "seconds": a.get("seconds"), "note": note,
                    "default": bool(a.get("default")), "overrides": a.get("overrides", []),
                    "run_dir": a.get("run_dir")})  # fmt: skip
    return out


def best_row(table: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The complete trial with the highest validation AUC (the lowest number on a tie)."""
    done = [r for r in table if r["state"] == "complete" and r["value"]]
    return max(done, key=lambda r: (r["value"]["auc"], -r["number"])) if done else None


def fmt_auc(value: dict[str, Any] | None) -> str:
    """``0.7461 [0.7321, 0.7601]`` (the interval when known)."""
    if not value:
        return "-"
    ci = value.get("auc_ci")
    return f"{value['auc']:.4f}" + (f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")


def unpaired(a: dict[str, Any], b: dict[str, Any]) -> str:
    """``a`` against ``b`` from their intervals alone: ahead, behind or within noise at 95%."""
    if not a.get("auc_ci") or not b.get("auc_ci"):
        return "no interval"
    se = math.hypot(*((v["auc_ci"][1] - v["auc_ci"][0]) / (2 * Z95) for v in (a, b)))
    delta = a["auc"] - b["auc"]
    verdict = "within noise" if abs(delta) <= Z95 * se else "ahead" if delta > 0 else "behind"
    return f"{verdict} ({delta:+.4f} AUC, ±{Z95 * se:.4f} at 95%, unpaired)"


def _param(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if v else "0"
    return str(v)


def markdown(args: SweepArgs, table: list[dict[str, Any]], lines: list[str]) -> str:
    """The report: a header (``lines``), then the trials' table."""
    names = sorted({k for r in table for k in r["params"]})
    head = ["trial", "state", "validation AUC [95% CI]", "rows", *names, "s", "note"]
    out = [f"# Sweep {args.study_name}: preset {args.base.name}", "", *lines, ""]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        v = r["value"] or {}
        rows_seen = f"{v['eval_rows']:,}" if v.get("eval_rows") else ""
        cells = [f"{r['number']}{' (preset)' if r['default'] else ''}", r["state"],
                 fmt_auc(r["value"]), rows_seen,
                 *(_param(r["params"][n]) if n in r["params"] else "" for n in names),
                 "" if r["seconds"] is None else f"{r['seconds']:.0f}",
                 r["note"].replace("|", "/")]  # fmt: skip
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out) + "\n"


def plot(table: list[dict[str, Any]], path: Path) -> Path:
    """``trials.png``: validation AUC per trial (interval bars; best so far as a step line)
    and each trial's validation AUC against training rows seen."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_curve) = plt.subplots(1, 2, figsize=(12, 4.2))
    best, xs, ys = -math.inf, [], []
    for r in table:
        v = r["value"]
        if not v or r["state"] not in ("complete", "pruned"):
            continue
        done = r["state"] == "complete"
        ci = v.get("auc_ci")
        err = [[v["auc"] - ci[0]], [ci[1] - v["auc"]]] if ci else None
        ax.errorbar(r["number"], v["auc"], yerr=err, fmt="o" if done else "x",
                    color="C0" if done else "C1", ms=5, capsize=2)  # fmt: skip
        if done:
            best = max(best, v["auc"])
            xs.append(r["number"])
            ys.append(best)
        curve = _curve(r.get("run_dir"))
        if curve:
            ax_curve.plot(*zip(*curve, strict=True), "-" if done else ":", lw=1, marker=".",
                          label=f"trial {r['number']}")  # fmt: skip
    if xs:
        ax.step(xs, ys, where="post", color="C2", label="best so far (complete)")
    ax.plot([], [], "o", color="C0", label="complete (last evaluation)")
    ax.plot([], [], "x", color="C1", label="pruned (last evaluation)")
    ax.set(title="validation AUC per trial (95% interval)", xlabel="trial", ylabel="AUC")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax_curve.set(title="validation AUC while training (dotted: pruned)",
                 xlabel="training rows seen", ylabel="AUC")  # fmt: skip
    ax_curve.grid(alpha=0.3)
    if 0 < len(ax_curve.lines) <= 12:
        ax_curve.legend(fontsize=7, ncol=2)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _curve(run_dir: str | None) -> list[tuple[int, float]]:
    metrics = Path(run_dir) / "metrics.jsonl" if run_dir else None
    if metrics is None or not metrics.is_file():
        return []
    return [(r.get("samples_seen", r.get("step", 0)), r["auc"])
            for r in valid_records(read_records(metrics))]  # fmt: skip


def _test_of(row: dict[str, Any]) -> dict[str, Any] | None:
    metrics = Path(row["run_dir"]) / "metrics.jsonl" if row.get("run_dir") else None
    return on_test(read_records(metrics)) if metrics and metrics.is_file() else None


def write(args: SweepArgs, study: Any) -> dict[str, Any]:
    """Write report.md, trials.png, summary.json and (with a complete trial) best.toml in the
    sweep folder; the summary (with the paths written)."""
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    table = rows(study)
    best = best_row(table)
    default = next((r for r in table if r["default"] and r["state"] == "complete"), None)
    states = {
        s: sum(r["state"] == s for r in table) for s in ("complete", "pruned", "fail", "running")
    }
    lines = [f"Trials: {len(table)} ({', '.join(f'{n} {s}' for s, n in states.items() if n)}); "
             f"objective: the validation AUC of each run's last evaluation."]  # fmt: skip
    summary: dict[str, Any] = {"study": args.study_name, "preset": args.base.name,
                               "trials": states, "best": None}  # fmt: skip
    if best:
        summary["best"] = {
            k: best[k] for k in ("number", "value", "params", "overrides", "run_dir")
        }
        lines.append(f"Best: trial {best['number']}, validation AUC {fmt_auc(best['value'])}: "
                     f"{' '.join(best['overrides']) or 'the preset as it is'}.")  # fmt: skip
        test = _test_of(best)
        if test:
            summary["best"]["test"] = test
            lines.append(f"Its test AUC (rows no decision saw): {fmt_auc(test)}.")
        if default and default is not best:
            verdict = unpaired(best["value"], default["value"])
            summary["best_vs_default"] = verdict
            lines.append(f"Against the preset (trial {default['number']}, "
                         f"{fmt_auc(default['value'])}): {verdict}.")  # fmt: skip
        elif default is best:
            lines.append("The preset's own config is the best found.")
        header = [f"make sweep: the best of study {args.study_name} (trial {best['number']}, "
                  f"validation AUC {fmt_auc(best['value'])})",
                  f"python -m training.train --config {out / 'best.toml'}"]  # fmt: skip
        paths = [*args.train_overrides, *best["overrides"]]
        best_toml = write_best(out / "best.toml", args.config.preset_path(), paths,
                               f"{args.base.name}-best", header)  # fmt: skip
        summary["best_toml"] = str(best_toml)
    else:
        lines.append("No trial completed yet: no best config.")
    report = out / "report.md"
    write_atomic(report, markdown(args, table, lines), durable=False)
    summary["report"], summary["plot"] = str(report), str(plot(table, out / "trials.png"))
    summary["lines"] = lines
    write_atomic(out / "summary.json", json.dumps(summary, indent=2, default=str), durable=False)
    return summary
