"""Parity of the scripted variants against the eager model, and in-process latency."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from recsys_stack.metrics import roc_auc
from training.data.loader import Arrays
from training.export.scorer import raw_inputs

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
) -> dict[str, Any]:
    """AUC of the reference (``reference``: TorchRec's eager model, or the streamed fp32
    tables) and each variant, max |Δp| vs the reference, and pass/fail of each threshold."""
    labels = np.asarray(arrays.labels, dtype=np.int64)
    ref = predict(eager, arrays)
    report: dict[str, Any] = {
        "rows": len(arrays),
        "reference": reference,
        "auc": {reference: roc_auc(labels, ref)},
        "checks": [],
    }
    report["max_abs_diff"] = {}
    for name, model in variants.items():
        p = predict(model, arrays)
        report["auc"][name] = roc_auc(labels, p)
        report["max_abs_diff"][name] = float(np.max(np.abs(p - ref)))
        if name in quantized:
            value = abs(report["auc"][name] - report["auc"][reference])
            limit, what = MAX_AUC_DROP_QUANT, f"|ΔAUC| {name} vs {reference}"
        else:  # fp32 and the portable fp32 variants: the same math, only float noise
            value, limit = report["max_abs_diff"][name], MAX_ABS_DIFF_FP32
            what = f"max |Δp| {name} vs {reference}"
        report["checks"].append(
            {"check": what, "variant": name, "value": value, "limit": limit, "ok": value <= limit}
        )
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report


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
