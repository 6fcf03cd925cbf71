"""Parity of the exported variants against the reference, and (on request) in-process latency.

Parity costs held-out rows x models, each model scoring the rows once. The latency table is a
loop of 50 rounds x 3 batch sizes per model: at the criteo-kaggle shape it took 146 of a
254 s export (the fp16 variant computes in fp16 on CPU, ~1 s a batch of 512 on a loaded
machine) and read 28 ms in one export and 84.5 ms in another under load, so the export
measures it only when asked (``--latency``) or when it must choose the fastest variant."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsys_stack.metrics import roc_auc
from training.data.loader import Arrays
from training.errors import DataError
from training.export.scorer import raw_inputs

logger = logging.getLogger("training.export")
Model = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MAX_ABS_DIFF_FP32 = 1e-5  # scripted fp32 vs eager: the same math, so only float noise
MAX_AUC_DROP_QUANT = 1e-3  # MLPerf's 99.9% rule, as an absolute AUC difference


def predict(model: Model, arrays: Arrays, batch_size: int = 4096) -> np.ndarray:
    """Probabilities float32[N] for every row of ``arrays`` (any model output dtype)."""
    out = []
    with torch.inference_mode():
        for lo in range(0, len(arrays), batch_size):
            hi = min(lo + batch_size, len(arrays))
            out.append(
                model(*raw_inputs(arrays.dense[lo:hi], arrays.sparse[lo:hi])).float().numpy()
            )
    return np.concatenate(out).astype(np.float32)


def parity_report(
    eager: Model,
    variants: dict[str, Model],
    arrays: Arrays,
    quantized: list[str],
    reference: str = "eager",
    sampled: dict[str, int] | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """AUC of the reference (``reference``: TorchRec's eager model, or the streamed fp32
    tables) and each variant, max |Δp| vs the reference, pass/fail of each threshold, and
    the seconds each model took; with the probabilities of every model on ``arrays``.

    Each model scores the rows once (its probabilities are also what ``sample.npz`` keeps):
    the cost is rows x models, with no latency loop (:func:`latency_report`, on request). A
    variant of ``sampled`` scores only that many of the first rows and is judged against the
    reference on the same rows (``rows_by_variant``): the fp16 tables this machine does not
    serve cost 391 s of a 488 s demo export on a CPU at 20,000 rows."""
    labels = np.asarray(arrays.labels, dtype=np.int64)
    sampled = {k: min(v, len(arrays)) for k, v in (sampled or {}).items() if v > 0}
    probs: dict[str, np.ndarray] = {}
    seconds: dict[str, float] = {}
    for name, model in {reference: eager, **variants}.items():
        t0 = time.perf_counter()
        n = sampled.get(name, len(arrays))
        probs[name] = predict(model, arrays if n == len(arrays) else arrays.rows(0, n))
        seconds[name] = time.perf_counter() - t0
    ref = probs[reference]
    report: dict[str, Any] = {
        "rows": len(arrays),
        "reference": reference,
        "auc": {reference: roc_auc(labels, ref)},
        "seconds": seconds,
        "checks": [],
    }
    if sampled:
        report["rows_by_variant"] = {name: sampled.get(name, len(arrays)) for name in variants}
    report["max_abs_diff"] = {}
    for name in variants:
        p = probs[name]
        n = len(p)
        report["auc"][name] = roc_auc(labels[:n], p)
        report["max_abs_diff"][name] = float(np.max(np.abs(p - ref[:n])))
        if name in quantized:
            ref_auc = report["auc"][reference] if n == len(ref) else roc_auc(labels[:n], ref[:n])
            value = abs(report["auc"][name] - ref_auc)
            limit, what = MAX_AUC_DROP_QUANT, f"|ΔAUC| {name} vs {reference}"
        else:  # fp32 and the portable fp32 variants: the same math, only float noise
            value, limit = report["max_abs_diff"][name], MAX_ABS_DIFF_FP32
            what = f"max |Δp| {name} vs {reference}"
        report["checks"].append(
            {"check": what, "variant": name, "value": value, "limit": limit, "ok": value <= limit}
        )
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report, probs


def gate(parity: dict[str, Any], force: bool) -> None:
    """Raise DataError naming each failed check, unless ``force`` (then recorded and warned)."""
    if parity["ok"]:
        return
    failed = "; ".join(
        f"{c['check']} = {c['value']:.2e} > {c['limit']:.0e}"
        for c in parity["checks"]
        if not c["ok"]
    )
    if not force:
        raise DataError(
            f"parity failed on {parity['rows']} rows: {failed} (--force exports anyway)"
        )
    parity["forced"] = True
    logger.warning("parity failed (%s); exporting because --force", failed)


def latency_report(
    models: dict[str, Model],
    arrays: Arrays,
    batch_sizes: tuple[int, ...] = (1, 100, 512),
    iters: int = 50,
) -> dict[str, dict[str, dict[str, float]]]:
    """p50/p99 milliseconds per forward, per variant and batch size, interleaved."""
    times: dict[str, dict[int, list[float]]] = {m: {b: [] for b in batch_sizes} for m in models}
    inputs = {
        b: raw_inputs(arrays.dense[:b], arrays.sparse[:b]) for b in batch_sizes if b <= len(arrays)
    }
    with torch.inference_mode():
        for _ in range(iters + 3):
            for b, x in inputs.items():
                for name, model in models.items():
                    t0 = time.perf_counter()
                    model(*x)
                    times[name][b].append((time.perf_counter() - t0) * 1e3)
    return {
        name: {
            str(b): {
                "p50_ms": float(np.percentile(ts[3:], 50)),
                "p99_ms": float(np.percentile(ts[3:], 99)),
            }
            for b, ts in per.items()
            if ts
        }
        for name, per in times.items()
    }


def write_sample(path: Path, arrays: Arrays, probs: dict[str, np.ndarray], rows: int) -> None:
    """``sample.npz``: the first ``rows`` parity rows encoded as the artifact takes them, their
    labels, and ``probs_<model>`` of each model, sliced from what parity scored (not again)."""
    n = min(rows, len(arrays))
    sample = arrays.rows(0, n)
    dense, values, lengths = raw_inputs(sample.dense, sample.sparse)
    out: dict[str, np.ndarray] = {
        "dense": dense.numpy(), "values": values.numpy(), "lengths": lengths.numpy(),
        "labels": np.asarray(sample.labels),
        **{f"probs_{name}": p[:n] for name, p in probs.items()},
    }  # fmt: skip
    np.savez(path, **out)  # type: ignore[arg-type]
