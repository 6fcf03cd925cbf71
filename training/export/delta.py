"""A checkpoint -> the delta over a served export: its rows that differ after quantization.

``python -m training.export.delta --run-dir RUN --checkpoint C --base EXPORT --deltas DIR``
streams the checkpoint's tables one at a time (as the export does, :mod:`.stream`), packs each
exactly as the export packs it, and keeps the rows whose bytes differ from what ``DIR``'s
workers serve now (the base export's mapped file with ``DIR``'s chain over it). Diffing after
quantization makes the chain + this delta score as a full export of the same checkpoint (to
float addition order), whatever the optimizer touched. The delta file (recsys_model/delta.py)
goes into ``DIR`` (``<store>/deltas/<model>/<base version>/``); its bytes are proportional to the
rows that changed, plus the dense weights. With ``--unseen-data``, the candidate (the chain +
this delta) and what serves now are scored on those rows in process, by the scorer the
workers run, and the delta is refused when the candidate's AUC is lower by more than
``--margin`` (the rollout's evaluated gate; exit 1). It is not published here: the pointer is
``serving.tools.deltas``' (or the continuous loop's) to move.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsys_model.delta import (
    DELTA_FORMATS,
    DeltaError,
    chain_state,
    merge,
    overlay,
    read_pointer,
    write_delta,
)
from recsys_model.mapped import load_mapped, pack, row_bytes
from training.checkpoint.rows import pread_into, read_metadata, table_rows
from training.export.portable import EBC
from training.export.scorer import CHECKPOINT_PREFIX
from training.export.stream import dense_scorer, mapped_name
from training.features import SPARSE_NAMES, table_name


def base_version(export: Path) -> str:
    """The version ``export``'s schema records (the ``.mar`` its tables went into)."""
    return str(json.loads((export / "schema.json").read_text())["model"]["version"])


def differing_rows(new: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Indices of the rows of ``uint8[n, W]`` ``new`` and ``ref`` that differ: compared as the
    widest words W divides, OR-ed across a row, then one flat nonzero (6x less CPU than
    ``(new != ref).any(dim=1).nonzero()`` on a 262k x 24 block, which dominated a delta)."""
    x, y = new.numpy(), ref.numpy()
    word = next(
        t for t in (np.uint64, np.uint32, np.uint16, np.uint8) if x.shape[1] % t().itemsize == 0
    )
    x, y = x.view(word), y.view(word)
    acc = x[:, 0] != y[:, 0]
    for j in range(1, x.shape[1]):
        acc |= x[:, j] != y[:, j]
    return torch.from_numpy(np.flatnonzero(acc))


def changed_rows(
    ckpt: Path, base: Any, fmt: str, ref_ids: torch.Tensor, ref_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ids and packed rows of ``ckpt``'s tables that differ from ``base``'s mapped
    file with ``ref`` over it. Read in blocks of rows into reused buffers (the checkpoint's
    rows by :func:`table_rows`, the base's by ``pread``): the tables are read once, no table
    is ever whole in memory, and no fresh memory is faulted in per table."""
    width, meta = row_bytes(base.dim, fmt), read_metadata(ckpt)
    ids, packed, start = [], [], 0
    old = torch.empty(0, width, dtype=torch.uint8)
    with open(base.tables_path, "rb") as served:  # a uniform file: the tables back to back
        for feature, n in zip(SPARSE_NAMES, base.spec["rows"], strict=True):
            key = f"{CHECKPOINT_PREFIX}{EBC}.{table_name(feature)}.weight"
            for first, block in table_rows(ckpt, key, meta=meta):
                new, at = pack(block, fmt), start + first
                if old.shape[0] < new.shape[0]:
                    old = torch.empty(new.shape[0], width, dtype=torch.uint8)
                ref = pread_into(served, old[: new.shape[0]], at * width)
                lo, hi = torch.searchsorted(ref_ids, torch.tensor([at, at + len(new)])).tolist()
                if hi > lo:  # rows the chain already replaced: compare with those
                    ref[ref_ids[lo:hi] - at] = ref_rows[lo:hi]
                local = differing_rows(new, ref)
                ids.append(local + at)
                packed.append(new[local])
            start += int(n)
    return torch.cat(ids), torch.cat(packed)


def make_delta(
    ckpt: Path, model_cfg: Any, export: Path, folder: Path, version: str, fmt: str = "int8"
) -> tuple[dict[str, Any], Any, Any]:
    """Write ``ckpt``'s delta over ``folder``'s chain on ``export``'s ``fmt`` tables; returns
    (its record: file, sha256, bytes, rows, row_bytes, dense_bytes, seconds; the scorer serving now; the
    candidate's)."""
    if fmt not in DELTA_FORMATS:
        raise DeltaError(f"deltas are made of {'/'.join(DELTA_FORMATS)} tables, not {fmt}")
    t0 = time.perf_counter()
    base_v = base_version(export)
    if folder.name != base_v:
        raise DeltaError(f"{folder} is not the deltas folder of {export} (version {base_v})")
    folder.mkdir(parents=True, exist_ok=True)
    mapped = export / mapped_name(fmt)
    base = load_mapped(mapped, torch.device("cpu"), verify=False)
    record = torch.load(mapped, map_location="cpu", weights_only=True)["tables"]
    ref_ids, ref_rows, ref_weights, parent = chain_state(folder)
    if ref_rows.numel() == 0:
        ref_rows = torch.empty(0, row_bytes(base.dim, fmt), dtype=torch.uint8)
    now = base if ref_weights is None else overlay(base, ref_ids, ref_rows, ref_weights, parent)
    ids, rows = changed_rows(ckpt, base, fmt, ref_ids, ref_rows)
    scorer = dense_scorer(ckpt, model_cfg)
    weights = {k: v for k, v in scorer.state_dict().items() if k != "weight"}
    delta = {"base": base_v, "base_sha256": record["sha256"], "parent": parent,
             "version": version, "format": fmt, "dim": base.dim, "ids": ids, "rows": rows,
             "weights": weights, "checkpoint": str(ckpt)}  # fmt: skip
    seq = len(read_pointer(folder)["chain"]) + 1
    out = write_delta(folder / f"{seq:04d}-{version}.pt", delta)
    merged = merge(ref_ids, ref_rows, ids, rows)
    candidate = overlay(base, *merged, weights, version)
    dense = sum(v.numel() * v.element_size() for v in weights.values())
    out.update(row_bytes=row_bytes(base.dim, fmt), dense_bytes=dense, parent=parent, chain=seq,
               seconds=round(time.perf_counter() - t0, 2))  # fmt: skip
    return out, now, candidate


def gate(now: Any, candidate: Any, arrays: Any, margin: float) -> dict[str, Any]:
    """Both scorers' AUC on ``arrays`` (rows the candidate never trained on); ``passed``."""
    from recsys_stack.metrics import roc_auc
    from training.export.parity import predict

    y = arrays.labels
    auc_now, auc_cand = (roc_auc(y, predict(m, arrays)) for m in (now, candidate))
    return {"auc_default": auc_now, "auc_candidate": auc_cand, "eval_rows": len(arrays),
            "passed": auc_cand >= auc_now - margin}  # fmt: skip


def unseen_arrays(path: Path, train_cfg: Any, rows: int) -> Any:
    """The first ``rows`` rows of ``path`` (0 = all), ids hashed for the model's tables."""
    from training.data.binary import ensure_binary, load_binary
    from training.data.loader import Arrays

    tables = list(train_cfg.model.rows())
    out_dir, _ = ensure_binary([path], Path(train_cfg.data.cache_dir), rows_per_table=tables)
    data = load_binary(out_dir)
    arrays = Arrays(data.labels, data.dense, data.sparse, data.prob, tuple(tables))
    return arrays.rows(0, min(len(arrays), rows or len(arrays)))


def main(argv: Sequence[str] | None = None) -> int:
    from training.checkpoint import store as checkpoint
    from training.config import config_from_dict

    p = argparse.ArgumentParser(prog="python -m training.export.delta", description=__doc__)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--checkpoint", type=Path, help="default: the run's latest")
    p.add_argument("--base", type=Path, required=True, help="the served version's export folder")
    p.add_argument("--deltas", type=Path, required=True, help="<store>/deltas/<model>/<base v>")
    p.add_argument("--version", required=True, help="the delta's label (e.g. the step)")
    p.add_argument("--format", default="int8", choices=DELTA_FORMATS)
    p.add_argument("--unseen-data", type=Path, help="rows to gate on (never trained on)")
    p.add_argument("--eval-rows", type=int, default=20_000)
    p.add_argument("--margin", type=float, default=0.002)
    a = p.parse_args(argv)
    ckpt = a.checkpoint or checkpoint.read_latest(a.run_dir / "checkpoints")
    if ckpt is None:
        print(f"error: {a.run_dir} has no checkpoint", file=sys.stderr)
        return 2
    cfg = config_from_dict(checkpoint.read_meta(ckpt)["config"])
    try:
        record, now, candidate = make_delta(ckpt, cfg.model, a.base, a.deltas, a.version, a.format)
    except (DeltaError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.unseen_data is not None:
        record["gate"] = gate(now, candidate, unseen_arrays(a.unseen_data, cfg, a.eval_rows),
                              a.margin)  # fmt: skip
    print(json.dumps(record), flush=True)  # a caller may read it before this process ends
    return 0 if record.get("gate", {}).get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
