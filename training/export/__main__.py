"""``python -m training.export --run-dir runs/demo``: parse, run the export pipeline, report.

The pipeline itself is :func:`training.export.pipeline.run_export`; its config,
:class:`~training.export.config.ExportConfig`, comes from ``--config FILE.toml``, a flag per
field (``--run-dir``, ``--formats``, ``--no-archive``, ...) and ``key=value`` overrides.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from recsys_stack import config as shared
from recsys_stack import logs, verdict
from training.config import load_stage_config
from training.errors import RecsysError
from training.export.config import ExportConfig

T = TypeVar("T")
EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, what a shell reports for a Ctrl-C'd command


def format_report(summary: dict[str, Any]) -> str:
    schema, parity = summary["schema"], summary["parity"]
    lines = [f"export: {summary['export_dir']}", f"archive: {summary['mar'] or '(skipped)'}", ""]
    # a mapped variant's size is its tables file plus the small file of its MLPs
    sizes = {
        v: d["bytes"] + d.get("tables", {}).get("bytes", 0) for v, d in schema["variants"].items()
    }
    ref = parity.get("reference", "eager")
    w = max(8, *(len(v) for v in sizes))
    lines.append(f"{'variant':<{w}}  size MiB   vs fp32   AUC       max|Δp| vs {ref}")
    sampled = sampled_rows(parity)
    for v, b in sizes.items():
        diff = parity["max_abs_diff"].get(v)
        lines.append(
            f"{v:<{w}} {b / 2**20:>9.2f} {sizes['fp32'] / b:>8.2f}x  {parity['auc'][v]:.5f}   "
            + (f"{diff:.2e}" if diff is not None else "(reference)")
            + (f"  (on its first {sampled[v]:,} rows: not served here)" if v in sampled else "")
        )
    if ref not in sizes:
        lines.append(
            f"{ref:<{w}} {'':>9} {'':>9}  {parity['auc'][ref]:.5f}   "
            f"(reference, {parity['rows']} rows)"
        )
    lines += ["", cost_line(parity, summary.get("timings", {}))]
    lat = parity.get("latency")
    if lat:
        lines += ["", "in-process latency, ms (p50 / p99)"]
        batches = list(next(iter(lat.values())))
        lines.append(f"{'model':<{w}} " + "".join(f"{'batch ' + b:>18}" for b in batches))
        for model, per in lat.items():
            lines.append(
                f"{model:<{w}} "
                + "".join(f"{per[b]['p50_ms']:>9.2f} / {per[b]['p99_ms']:<6.2f}" for b in batches)
            )
    if lat and "portable_onnx" in lat and "100" in lat["portable_onnx"]:
        ratio = lat["portable_onnx"]["100"]["p50_ms"] / lat["fp32"]["100"]["p50_ms"]
        lines.append(f"ONNX (onnxruntime) / mapped fp32 at batch 100: {ratio:.2f}x")
    serving = schema.get("serving", {})
    if serving:
        fastest = f" (fastest here: {serving.get('fastest_cpu')})" if lat else ""
        lines.append(
            f"served: cpu {serving['cpu']}{fastest}, "
            f"cuda {serving.get('cuda')} in {serving.get('cuda_dtype')}"
        )
    for c in parity["checks"]:
        lines.append(
            f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']} = {c['value']:.2e} (limit {c['limit']:.0e})"
        )
    lost = verdict.schema_warning(schema)  # last: what a user reads (schema.json: quality)
    return "\n".join(lines + ([f"WARNING: {lost}"] if lost else []))


def sampled_rows(parity: dict[str, Any]) -> dict[str, int]:
    """The variants checked on their first n parity rows only (not served here): n."""
    return {v: n for v, n in parity.get("rows_by_variant", {}).items() if n < parity["rows"]}


def cost_line(parity: dict[str, Any], timings: dict[str, float]) -> str:
    """What the export's stages took, parity's per model: its cost is rows x models."""
    per = ", ".join(f"{m} {t:.1f} s" for m, t in parity.get("seconds", {}).items())
    stages = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in timings.items())
    latency = "" if "latency" in parity else "; latency not measured (--latency)"
    some = ", ".join(f"{v} {n:,}" for v, n in sampled_rows(parity).items())
    rows = f"{parity['rows']:,} held-out rows" + (f" ({some})" if some else "")
    return (f"parity: {rows}, each model once ({per}){latency}\n"
            f"seconds: {stages} ({sum(timings.values()):.1f} s in all)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = shared.ArgumentParser(
        prog="python -m training.export",
        usage="%(prog)s (--run-dir DIR | --checkpoint DIR) [options] [key=value ...]",
        description="Export a training checkpoint: its tables streamed one at a time into "
        "mapped files (int8 for CPU workers, fp16 for GPUs, fp32 as trained), other formats on "
        "request (--formats), parity checked on held-out rows, archived as a versioned "
        "TorchServe .mar (weights stored, not deflated).",
    )
    return shared.add_config_args(p, ExportConfig)


def parse_args(argv: Sequence[str] | None = None) -> ExportConfig:
    """``argv`` -> the export config. Raises ConfigError (a bad key, or no checkpoint named)."""
    ecfg = load_stage_config(ExportConfig, build_parser().parse_intermixed_args(argv))
    ecfg.validate()
    return ecfg


INTERRUPTED = (
    "interrupted (Ctrl-C): nothing was exported; the run's last export and the model store are "
    "as they were (run the same command again to export)"
)


def interruptible(fn: Callable[[], T]) -> T:
    """``fn()`` in a worker thread, the main thread waiting in short steps: a Ctrl-C is seen
    within 0.1 s even while the worker is inside one long torch call (it took ~60 s to take
    effect, then a 10-frame traceback). On Ctrl-C the export's temporary folders are removed,
    one line is printed and the process exits 130 (the worker cannot be stopped: ``os._exit``;
    an export is only ever swapped in whole, training/export/pipeline.py)."""
    result: list[T] = []
    error: list[BaseException] = []

    def work() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # handed to the main thread as it is
            error.append(e)

    worker = threading.Thread(target=work, name="export", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
    except KeyboardInterrupt:
        from training.export.pipeline import TEMPORARY

        for path in TEMPORARY:
            shutil.rmtree(path, ignore_errors=True)
        print(INTERRUPTED, file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)
    if error:
        raise error[0]
    return result[0]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        ecfg = parse_args(argv)  # before torch: a --help or a bad flag answers at once
        from training.export.pipeline import logger, run_export

        logs.configure()  # after torch's import, which sets its loggers' levels of its own
        summary = interruptible(lambda: run_export(ecfg))
    except RecsysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the worker started (the imports)
        print(INTERRUPTED, file=sys.stderr)
        return EXIT_INTERRUPTED
    print(format_report(summary))
    logger.debug("config %s", shared.to_dict(ecfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
