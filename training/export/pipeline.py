"""``python -m training.export --run-dir runs/demo``: checkpoint -> TorchScript -> model store.

Writes ``<run>/export/`` (``model_fp32.pt``, ``model_<quant>.pt``, ``schema.json``,
``parity.json``, ``sample.npz``) and ``model_store/<name>-<version>.mar``. Everything is built
in a temporary folder and moved into place only when parity holds (or ``--force`` is given and
recorded), so a failed export leaves the previous export and the model store untouched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.errors import DataError, RecsysError
from training.export.archive import archive, check_target
from training.export.parity import latency_report, parity_report, predict
from training.export.scorer import (
    CPU_ROW_ALIGNMENT,
    eager_scorer,
    load_dlrm,
    raw_inputs,
    resolve_checkpoint,
    script_variant,
)
from training.features import DENSE_NAMES, SPARSE_NAMES, table_name
from training.loader import Arrays

logger = logging.getLogger("training.export")
SCHEMA_VERSION = 1
SAMPLE_ROWS = 1000
# Modules the handler imports, archived beside it (TorchServe puts them on the worker's path).
HANDLER_MODULES = ("codec.py", "scoring.py")


@dataclass
class ExportConfig:
    run_dir: Path | None = None
    """Run directory whose checkpoints/latest is exported."""
    checkpoint: Path | None = None
    """A specific step directory instead of the run's latest."""
    quant: str = "int8"
    """Embedding variant served from the .mar: int8 | fp16 | none (= fp32)."""
    name: str = ""
    """Model name (default: dlrm-<preset>)."""
    version: str = ""
    """Model version (default: the checkpoint's step)."""
    model_store: Path = Path("model_store")
    """Where the .mar goes."""
    handler: Path = Path("serving/handler.py")
    """TorchServe handler archived with the model."""
    parity_rows: int = 20_000
    """Held-out rows for the parity check (the run's eval split unless --eval-data)."""
    eval_data: Path | None = None
    """A Criteo TSV to check parity on instead of the run's eval split."""
    force: bool = False
    """Export even when parity fails (recorded in parity.json and schema.json)."""
    overwrite: bool = False
    """Replace an existing <name>-<version>.mar."""
    archive: bool = True
    """Build the .mar (off: only the export directory)."""
    progress: bool = True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parity_arrays(ecfg: ExportConfig, train_cfg: Any) -> Arrays:
    """Held-out rows: ``--eval-data`` or the run's eval split, at most ``parity_rows``."""
    from training.data.binary import ensure_binary, load_binary
    from training.data_prep import prepare_data

    if ecfg.eval_data is not None:
        out_dir, _ = ensure_binary(
            [ecfg.eval_data], Path(train_cfg.data.cache_dir), progress=ecfg.progress
        )
        data = load_binary(out_dir)
        arrays = Arrays(data.labels, data.dense, data.sparse, data.prob)
    else:
        arrays = prepare_data(train_cfg.data, rank=0, progress=ecfg.progress)[1]
    arrays = arrays.rows(0, min(len(arrays), ecfg.parity_rows))
    if len(arrays) == 0:
        raise DataError("the eval set is empty: parity needs held-out rows (see --eval-data)")
    if len(set(np.asarray(arrays.labels).tolist())) < 2:
        raise DataError(f"the {len(arrays)} eval rows have a single label: AUC is undefined")
    return arrays


def build_schema(
    ecfg: ExportConfig,
    cfg: Any,
    meta: dict[str, Any],
    ckpt: Path,
    files: dict[str, Path],
    parity: dict[str, Any],
    served: str,
) -> dict[str, Any]:
    rows = cfg.model.rows()
    return {
        "schema_version": SCHEMA_VERSION,
        "model": {"name": ecfg.name, "version": ecfg.version, "arch": cfg.model.arch},
        "features": {"dense": list(DENSE_NAMES), "sparse": list(SPARSE_NAMES)},
        "tables": [
            {"feature": f, "table": table_name(f), "rows": r, "dim": cfg.model.embedding_dim}
            for f, r in zip(SPARSE_NAMES, rows, strict=True)
        ],
        "inputs": {
            "dense": "float32[B, 13] raw values, missing = 0",
            "values": "int64[N] raw non-negative ids, grouped by feature (schema order), then example",
            "lengths": "int32[26, B] ids per feature and example (0 = missing)",
        },
        "output": "float32[B] click probability",
        "transforms": {"dense": "log1p(max(x, 0))", "ids": "id mod rows (per table)"},
        "variants": {
            v: {"file": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)}
            for v, p in files.items()
        },
        "served_variant": served,
        # Quantized tables are fbgemm CPU TBEs with unpadded rows; a CUDA artifact needs its own
        # export (16-byte rows, TBEs created on the GPU).
        "target": {"device": "cpu", "row_alignment": CPU_ROW_ALIGNMENT},
        "source": {
            "checkpoint": str(ckpt.resolve()),
            "step": meta.get("progress", {}).get("step"),
            "preset": cfg.name,
            "world_size": meta.get("world_size"),
        },
        "training_metrics": meta.get("metrics", {}),
        "parity": {"ok": parity["ok"], "forced": parity.get("forced", False), "auc": parity["auc"]},
        "versions": {"torch": torch.__version__},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run_export(ecfg: ExportConfig) -> dict[str, Any]:
    """The whole export; returns a summary (paths, sizes, parity, latency)."""
    ckpt = resolve_checkpoint(ecfg.run_dir, ecfg.checkpoint)
    run_dir = ecfg.run_dir or ckpt.parent.parent
    dlrm, cfg, meta = load_dlrm(ckpt)
    step = meta.get("progress", {}).get("step", 0)
    ecfg.name = ecfg.name or f"dlrm-{cfg.name}"
    ecfg.version = ecfg.version or str(step)
    if ecfg.archive:
        check_target(ecfg.model_store, ecfg.name, ecfg.version, ecfg.overwrite)
    arrays = parity_arrays(ecfg, cfg)
    variants = ["fp32"] + ([] if ecfg.quant == "none" else [ecfg.quant])
    served = variants[-1]

    final = run_dir / "export"
    tmp = run_dir / f".export.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        files: dict[str, Path] = {}
        for v in variants:
            files[v] = tmp / f"model_{v}.pt"
            script_variant(dlrm, cfg, v).save(str(files[v]))  # type: ignore[arg-type]
        loaded = {v: torch.jit.load(str(p)) for v, p in files.items()}  # check what was saved
        eager = eager_scorer(dlrm, cfg)
        parity = parity_report(eager, loaded, arrays, quantized=variants[1:])
        if not parity["ok"]:
            failed = "; ".join(
                f"{c['check']} = {c['value']:.2e} > {c['limit']:.0e}"
                for c in parity["checks"]
                if not c["ok"]
            )
            if not ecfg.force:
                raise DataError(
                    f"parity failed on {parity['rows']} rows: {failed} (--force exports anyway)"
                )
            parity["forced"] = True
            logger.warning("parity failed (%s); exporting because --force", failed)
        parity["latency"] = latency_report({"eager": eager, **loaded}, arrays)
        (tmp / "parity.json").write_text(json.dumps(parity, indent=2))
        sample = arrays.rows(0, min(SAMPLE_ROWS, len(arrays)))
        dense, values, lengths = raw_inputs(sample.dense, sample.sparse)
        arrays_out: dict[str, np.ndarray] = {
            "dense": dense.numpy(), "values": values.numpy(), "lengths": lengths.numpy(),
            "labels": np.asarray(sample.labels),
            **{f"probs_{v}": predict(m, sample) for v, m in loaded.items()},
        }  # fmt: skip
        np.savez(tmp / "sample.npz", **arrays_out)  # type: ignore[arg-type]
        schema = build_schema(ecfg, cfg, meta, ckpt, files, parity, served)
        (tmp / "schema.json").write_text(json.dumps(schema, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    mar = None
    if ecfg.archive:
        mar = archive(
            final, f"model_{served}.pt", ecfg.handler,
            [final / "schema.json", final / "parity.json"]
            + [ecfg.handler.parent / m for m in HANDLER_MODULES],
            ecfg.model_store, ecfg.name, ecfg.version, ecfg.overwrite,
        )  # fmt: skip
    return {
        "export_dir": str(final),
        "mar": str(mar) if mar else None,
        "schema": schema,
        "parity": parity,
    }


def format_report(summary: dict[str, Any]) -> str:
    schema, parity = summary["schema"], summary["parity"]
    lines = [f"export: {summary['export_dir']}", f"archive: {summary['mar'] or '(skipped)'}", ""]
    sizes = {v: d["bytes"] for v, d in schema["variants"].items()}
    lines.append("variant   size MiB   vs fp32   AUC       max|Δp| vs eager")
    for v, b in sizes.items():
        lines.append(
            f"{v:<8} {b / 2**20:>9.2f} {sizes['fp32'] / b:>8.2f}x  {parity['auc'][v]:.5f}   {parity['max_abs_diff'][v]:.2e}"
        )
    lines.append(
        f"eager    {'':>9} {'':>9}  {parity['auc']['eager']:.5f}   (reference, {parity['rows']} rows)"
    )
    lines.append("")
    lines.append("in-process latency, ms (p50 / p99)")
    lat = parity["latency"]
    batches = list(next(iter(lat.values())))
    lines.append("model    " + "".join(f"{'batch ' + b:>18}" for b in batches))
    for model, per in lat.items():
        lines.append(
            f"{model:<8} "
            + "".join(f"{per[b]['p50_ms']:>9.2f} / {per[b]['p99_ms']:<6.2f}" for b in batches)
        )
    for c in parity["checks"]:
        lines.append(
            f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']} = {c['value']:.2e} (limit {c['limit']:.0e})"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> ExportConfig:
    p = argparse.ArgumentParser(
        prog="python -m training.export",
        description="Export a training checkpoint as self-contained TorchScript (fp32 and "
        "quantized embeddings), check parity against the eager model on held-out rows, and "
        "archive it as a versioned TorchServe .mar.",
    )
    d = ExportConfig()
    p.add_argument("--run-dir", type=Path, help="run directory (its checkpoints/latest)")
    p.add_argument("--checkpoint", type=Path, help="a step directory instead of latest")
    p.add_argument(
        "--quant",
        choices=["int8", "fp16", "none"],
        default=d.quant,
        help="served embedding variant (default int8)",
    )
    p.add_argument("--name", default="", help="model name (default dlrm-<preset>)")
    p.add_argument("--version", default="", help="model version (default: the checkpoint step)")
    p.add_argument("--model-store", type=Path, default=d.model_store, help="default model_store/")
    p.add_argument("--handler", type=Path, default=d.handler, help="default serving/handler.py")
    p.add_argument(
        "--parity-rows",
        type=int,
        default=d.parity_rows,
        help="held-out rows checked (default 20000)",
    )
    p.add_argument(
        "--eval-data",
        type=Path,
        help="Criteo TSV for the parity check instead of the run's eval split",
    )
    p.add_argument("--force", action="store_true", help="export even if parity fails (recorded)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing <name>-<version>.mar"
    )
    p.add_argument("--no-archive", action="store_true", help="only write <run>/export/")
    p.add_argument("--no-progress", action="store_true")
    ns = p.parse_args(argv)
    if ns.run_dir is None and ns.checkpoint is None:
        p.error("give --run-dir or --checkpoint")
    return ExportConfig(
        run_dir=ns.run_dir, checkpoint=ns.checkpoint, quant=ns.quant, name=ns.name,
        version=ns.version, model_store=ns.model_store, handler=ns.handler,
        parity_rows=ns.parity_rows, eval_data=ns.eval_data, force=ns.force,
        overwrite=ns.overwrite, archive=not ns.no_archive, progress=not ns.no_progress,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    from training.train import configure_logging

    verbose = os.environ.get("RECSYS_VERBOSE", "") not in ("", "0")
    configure_logging(rank=0, verbose=verbose)
    if not verbose:  # TorchScript compiling torchrec classes warns through the ast module
        warnings.filterwarnings("ignore", message="The TorchScript type system")
    try:
        ecfg = parse_args(argv)
        summary = run_export(ecfg)
    except RecsysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(summary))
    logger.debug("config %s", asdict(ecfg))
    return 0
