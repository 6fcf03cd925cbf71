"""The export pipeline: checkpoint -> variants (:mod:`training.export.variants`) -> parity ->
schema -> model store.

:func:`run_export` (``python -m training.export --run-dir runs/demo``, see ``__main__``) writes
``<run>/export/`` (by default ``mapped_<fmt>.pt`` + ``tables_<fmt>.bin`` for int8, fp16 and
fp32; the files of any other format asked for; ``schema.json``, ``parity.json``,
``sample.npz``) and ``model_store/<name>-<version>.mar``. Everything is built
aside first: the export directory in ``<run>/.export.tmp-<pid>``, the .mar (archived from that
folder) in ``<model_store>/.export-<pid>/``. Only when parity holds (or ``--force`` is given and
recorded) and the archive is built are they swapped in: the old export directory is renamed
aside, the new one renamed in, the .mar moved over the old one with ``os.replace``, then the old
directory deleted. A failure at any step (the archiver included) leaves the previous export and
the previous .mar untouched and removes the partial files, so ``schema.json`` never names a
version whose .mar is missing. An export killed between the two directory renames leaves the
old one in ``<run>/.export.old-<pid>``; the next export puts it back before starting.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import recsys_model
from recsys_model.features import DESCRIPTION as TRANSFORMS
from recsys_stack import verdict
from training.data.loader import Arrays
from training.errors import DataError
from training.export import variants
from training.export.archive import archive, check_owner, check_target
from training.export.config import ExportConfig
from training.export.parity import gate, latency_report, parity_report, write_sample
from training.export.record import data_record
from training.export.scorer import CPU_ROW_ALIGNMENT, load_config, resolve_checkpoint
from training.features import DENSE_NAMES, SPARSE_NAMES, table_name

logger = logging.getLogger("training.export")
SCHEMA_VERSION = 1
SAMPLE_ROWS = 1000
# Modules the handler imports, archived flat beside it (TorchServe puts them on the worker's
# path): the worker's own, from the handler's folder, and the model's, from recsys_model/.
HANDLER_MODULES = ("codec.py", "scoring.py", "deltas.py")
MODEL_MODULES = ("mapped.py", "portable_model.py", "features.py", "delta.py", "atomic.py")
MODEL_DIR = Path(recsys_model.__file__).parent
# Reduced precision: judged by |ΔAUC| against the reference; the rest by max |Δp|.
REDUCED = ("int8", "int4", "mixed", "fp16", "ts_int8", "portable_fp16")
# What a CUDA worker loads, carried in the .mar beside the CPU variant: the mapped fp16 tables
# (copied to the device), else the portable TorchScript pair of an export that has one.
CUDA_VARIANTS = (("fp16",), ("portable", "portable_fp16"))
# this process's folders of an export in progress (its own build and the archive's staging):
# removed when the export is interrupted, as its own finally would
TEMPORARY: list[Path] = []
# variants only CUDA workers serve (their parity on a CPU: a sample, unserved_parity_rows)
GPU_ONLY = ("fp16", "portable_fp16")
LATENCY_BATCH = "100"  # the batch size variants are compared (and the CPU's fastest chosen) at


def parity_arrays(ecfg: ExportConfig, train_cfg: Any) -> Arrays:
    """Rows the checkpoint did not train on: ``--eval-data``, ``--unseen-data`` or the run's
    test split, at most ``parity_rows``."""
    from training.data.binary import ensure_binary, load_binary
    from training.data.prep import prepare_data

    tables = list(train_cfg.model.rows())  # the cache training built: ids hashed once
    given = ecfg.eval_data or ecfg.unseen_data
    if given is not None:
        out_dir, _ = ensure_binary(
            [given], Path(train_cfg.data.cache_dir), progress=ecfg.progress,
            rows_per_table=tables,
        )  # fmt: skip
        data = load_binary(out_dir)
        arrays = Arrays(data.labels, data.dense, data.sparse, data.prob, tuple(tables))
    else:
        arrays = prepare_data(train_cfg.data, 0, ecfg.progress, rows_per_table=tables).test
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
    run_dir: Path,
    files: dict[str, Path],
    parity: dict[str, Any],
    served: str,
    fastest: str | None = None,
    cuda: tuple[str, ...] = (),
    budget: dict[str, Any] | None = None,
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
        "transforms": dict(TRANSFORMS),
        "variants": {v: variants.info(v, p) for v, p in files.items()},
        "served_variant": served,
        **({"memory_budget": budget} if budget else {}),
        # What the handler loads per device (serving/worker/handler.py: choose_variant).
        "serving": {
            "cpu": served,
            "cuda": cuda[0] if cuda else None,
            "cuda_dtype": ecfg.cuda_dtype,
            "fastest_cpu": fastest,
        },
        # Quantized tables are fbgemm CPU TBEs with unpadded rows; a CUDA artifact needs its own
        # export (16-byte rows, TBEs created on the GPU).
        "target": {"device": "cpu", "row_alignment": CPU_ROW_ALIGNMENT},
        "source": {
            "checkpoint": str(ckpt.resolve()),
            "step": meta.get("progress", {}).get("step"),
            "preset": cfg.name,
            "run_dir": str(run_dir.resolve()),
            "world_size": meta.get("world_size"),
        },
        "data": data_record(cfg, meta, ecfg.unseen_data),
        "training_metrics": meta.get("metrics", {}),
        # against its linear baseline (recsys_stack.verdict): make export and make serve warn
        "quality": verdict.quality(meta.get("metrics", {}), f"{ecfg.name} v{ecfg.version}"),
        "parity": {"ok": parity["ok"], "forced": parity.get("forced", False), "auc": parity["auc"]},
        "versions": {"torch": torch.__version__},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def fastest_cpu(
    latency: dict[str, Any], files: dict[str, Path], parity: dict[str, Any]
) -> str | None:
    """The TorchScript variant with the lowest p50 at batch 100 among those passing parity."""
    failed = {c["variant"] for c in parity["checks"] if not c["ok"]}
    ok = [
        v for v in files
        if v not in failed and files[v].suffix == ".pt" and LATENCY_BATCH in latency.get(v, {})
    ]  # fmt: skip
    return min(ok, key=lambda v: latency[v][LATENCY_BATCH]["p50_ms"], default=None)


def _swap_in(
    tmp: Path, final: Path, aside: Path, built: Path | None, target: Path | None
) -> Path | None:
    """Move the export built in ``tmp`` to ``final`` and the .mar ``built`` to ``target``.

    The previous export is renamed to ``aside`` (not deleted) until the .mar is in place; a
    failure before that puts it back, so the export directory and the .mar change together.
    """
    had_old = final.exists()
    if had_old:
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    try:
        os.replace(tmp, final)
        if built is not None and target is not None:
            os.replace(built, target)
    except BaseException:
        if had_old:
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            os.replace(aside, final)
        raise
    if had_old:
        shutil.rmtree(aside, ignore_errors=True)
    return target


def _recover_export(final: Path) -> None:
    """Put back the export an interrupted swap left aside (``.export.old-<pid>``) when no
    export directory is in place; delete such leftovers otherwise."""
    olds = sorted(final.parent.glob(".export.old-*"), key=lambda p: p.stat().st_mtime)
    for old in reversed(olds):  # the newest first
        if not final.exists() and (old / "schema.json").is_file():
            logger.warning("%s: restoring the export an interrupted swap moved aside", final)
            os.replace(old, final)
        else:
            shutil.rmtree(old, ignore_errors=True)


def run_export(ecfg: ExportConfig) -> dict[str, Any]:
    """The whole export; returns a summary (paths, sizes, parity, latency)."""
    ckpt = resolve_checkpoint(ecfg.run_dir, ecfg.checkpoint)
    run_dir = ecfg.run_dir or ckpt.parent.parent
    cfg, meta = load_config(ckpt)
    step = meta.get("progress", {}).get("step", 0)
    named = bool(ecfg.name)
    ecfg = dataclasses.replace(
        ecfg, name=ecfg.name or f"dlrm-{cfg.name}", version=ecfg.version or str(step)
    )
    if ecfg.archive:
        check_target(ecfg.model_store, ecfg.name, ecfg.version, ecfg.overwrite)
        if not named:  # the preset's name: not over another run's model (schema: source.run_dir)
            check_owner(ecfg.model_store, ecfg.name, run_dir)
    arrays = parity_arrays(ecfg, cfg)
    final = run_dir / "export"
    _recover_export(final)
    tmp = run_dir / f".export.tmp-{os.getpid()}"
    aside = run_dir / f".export.old-{os.getpid()}"
    staging = ecfg.model_store / f".export-{os.getpid()}"
    TEMPORARY[:] = [tmp, staging]  # what an interrupt removes (training/export/__main__.py)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mar = None
    timings: dict[str, float] = {}  # seconds of each stage, in order
    clock = [time.perf_counter()]

    def lap(stage: str) -> None:
        now = time.perf_counter()
        timings[f"{stage}_s"], clock[0] = now - clock[0], now

    try:
        built_variants = variants.build(
            ckpt,
            cfg,
            tmp,
            list(ecfg.formats),
            arrays,
            ecfg.eager_check_bytes,
            ecfg.progress,
            ecfg.memory_budget,
        )
        files, loaded = built_variants.files, built_variants.models
        ref, ref_model = built_variants.reference, built_variants.reference_model
        compared = {v: m for v, m in loaded.items() if not (ref == "fp32" and v == "fp32")}
        reduced = [v for v in loaded if v in REDUCED]
        lap("variants")
        # check what was saved, as loaded back: each model scores the parity rows once
        # variants this machine does not serve (fp16 tables on a CPU: CUDA workers load them)
        # are checked on a sample: fp16 on a CPU is the slowest model of the export by far
        sampled = {} if torch.cuda.is_available() else {
            v: ecfg.unserved_parity_rows for v in compared
            if v in GPU_ONLY and v != ecfg.cpu_variant
        }  # fmt: skip
        parity, probs = parity_report(ref_model, compared, arrays, reduced, ref, sampled)
        gate(parity, ecfg.force)
        write_sample(tmp / "sample.npz", arrays, probs, SAMPLE_ROWS)
        lap("parity")
        if ecfg.latency or ecfg.cpu_variant == "fastest":  # "fastest" is chosen by it
            parity["latency"] = latency_report({ref: ref_model, **compared}, arrays)
            lap("latency")
        fastest = fastest_cpu(parity.get("latency", {}), files, parity)
        served = fastest if ecfg.cpu_variant == "fastest" and fastest else ecfg.cpu_variant
        if served == "fastest":  # nothing measured passed: the default
            served = "int8" if "int8" in files else next(iter(files))
        if "mixed" in files and served == "int8":  # a budget: what fits it is served
            served = "mixed"
        cuda = next((c for c in CUDA_VARIANTS if all(v in files for v in c)), ())
        (tmp / "parity.json").write_text(json.dumps(parity, indent=2))
        schema = build_schema(
            ecfg, cfg, meta, ckpt, run_dir, files, parity, served, fastest, cuda,
            built_variants.budget,
        )  # fmt: skip
        (tmp / "schema.json").write_text(json.dumps(schema, indent=2))
        lap("schema")
        built = None
        if ecfg.archive:  # from the folder built aside, into a staging folder in the store
            ecfg.model_store.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            carried = variants.archived(files, served, cuda)
            built = archive(
                tmp, carried[0].name, ecfg.handler,
                [tmp / "schema.json", tmp / "parity.json", *carried[1:]]
                + [ecfg.handler.parent / m for m in HANDLER_MODULES]
                + [MODEL_DIR / m for m in MODEL_MODULES],
                staging, ecfg.name, ecfg.version, True,
            )  # fmt: skip
            # Checked again right before the swap: another export may have taken the version.
            check_target(ecfg.model_store, ecfg.name, ecfg.version, ecfg.overwrite)
        lap("archive")
        (tmp / "timings.json").write_text(json.dumps(timings, indent=2))
        mar = _swap_in(tmp, final, aside, built, ecfg.model_store / built.name if built else None)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
    return {
        "export_dir": str(final),
        "mar": str(mar) if mar else None,
        "schema": schema,
        "parity": parity,
        "timings": timings,
    }
