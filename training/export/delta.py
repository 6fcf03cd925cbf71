"""A checkpoint -> the delta over a served export: its rows that differ after quantization.

``python -m training.export.delta --run-dir RUN --checkpoint C --base EXPORT --deltas DIR``
streams the checkpoint's tables one at a time (as the export does, :mod:`.stream`), packs each
exactly as the export packs it, and keeps the rows whose bytes differ from what ``DIR``'s
workers serve now (the base export's mapped file with ``DIR``'s chain over it). Diffing after
quantization makes the chain + this delta score as a full export of the same checkpoint (to
float addition order), whatever the optimizer touched. The tables are those the workers serve
(``--format``, by default the export's CPU variant): int8, int4, or mixed, section by section
(each table in its own format); other variants have no delta path (a full export). The delta
file (recsys_model/delta.py) goes into ``DIR`` (``<store>/deltas/<model>/<base version>/``);
its bytes are proportional to the rows that changed, plus the dense weights. With
``--unseen-data``, the candidate (the chain + this delta) and what serves now are scored on
those rows in process, by the scorer the workers run, and their probabilities saved beside the
delta (``NNNN-<label>.judge.npz``, named in the record's ``gate``): ``serving.tools.deltas
publish`` judges them by the rollout's rules (its ``--margin``, the near-chance refusal) before
it moves the pointer. It is not published here: the pointer is ``serving.tools.deltas``' (or
the continuous loop's) to move.
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
    Parts,
    as_file,
    chain_state,
    merge_parts,
    overlay,
    read_pointer,
    write_delta,
)
from recsys_model.mapped import layout, load_mapped, pack, row_bytes
from training.checkpoint.rows import pread_into, read_metadata, rows_at, table_rows
from training.export.portable import EBC
from training.export.scorer import CHECKPOINT_PREFIX
from training.export.stream import dense_scorer, mapped_name
from training.features import SPARSE_NAMES, table_name


def base_version(export: Path) -> str:
    """The version ``export``'s schema records (the ``.mar`` its tables went into)."""
    return str(json.loads((export / "schema.json").read_text())["model"]["version"])


def served_format(schema: dict[str, Any]) -> tuple[str | None, str]:
    """``(the format of the tables CPU workers serve, "")`` when a delta can be made for
    them (mapped int8, int4 or mixed: schema.json's ``serving.cpu``), else ``(None, why)``."""
    variant = str(schema.get("serving", {}).get("cpu") or schema.get("served_variant"))
    info = schema.get("variants", {}).get(variant, {})
    if info.get("kind") == "mapped" and variant in DELTA_FORMATS:
        return variant, ""
    return None, (f"the workers serve {variant} ({info.get('kind', 'unknown kind')}): no "
                  f"delta path ({'/'.join(DELTA_FORMATS)} mapped tables only)")  # fmt: skip


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
    ckpt: Path, base: Any, record: dict[str, Any], ref: Parts,
    touched: Sequence[np.ndarray] | None = None,
) -> Parts:  # fmt: skip
    """Per section of ``base``'s mapped file (its tables' ``record``: one format, or each
    table's for ``mixed``): the ids and packed rows of ``ckpt``'s tables that differ from the
    file with ``ref`` over it. Read in blocks of rows into reused buffers (the checkpoint's
    rows by :func:`table_rows`, the base's by ``pread``): the tables are read once, no table
    is ever whole in memory, and no fresh memory is faulted in per table. ``touched`` (each
    table's sorted rows that may differ, a superset: what the passes since the served state
    trained on): only those rows are read and compared (:func:`changed_among`)."""
    rows_of = [int(r) for r in base.spec["rows"]]
    formats = record.get("formats") or [record["format"]] * len(rows_of)
    local, sections, _ = layout(rows_of, base.dim, formats)
    meta = read_metadata(ckpt)
    if touched is not None:
        return changed_among(ckpt, base, formats, (local, sections), ref, touched, meta)
    found: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {
        f: ([], []) for f in sections
    }
    old = torch.empty(0, dtype=torch.uint8)
    with open(base.tables_path, "rb") as served:
        for t, feature in enumerate(SPARSE_NAMES):
            fmt, width = formats[t], row_bytes(base.dim, formats[t])
            ref_ids, ref_rows = ref.get(fmt) or (torch.empty(0, dtype=torch.int64), None)
            key = f"{CHECKPOINT_PREFIX}{EBC}.{table_name(feature)}.weight"
            for first, block in table_rows(ckpt, key, meta=meta):
                new, at = pack(block, fmt), local[t] + first  # at: the row in its section
                if old.numel() < new.numel():
                    old = torch.empty(new.numel(), dtype=torch.uint8)
                now = pread_into(served, old[: new.numel()].view(-1, width),
                                 sections[fmt][0] + at * width)  # fmt: skip
                lo, hi = torch.searchsorted(ref_ids, torch.tensor([at, at + len(new)])).tolist()
                if hi > lo:  # rows the chain already replaced: compare with those
                    assert ref_rows is not None
                    now[ref_ids[lo:hi] - at] = ref_rows[lo:hi]
                changed = differing_rows(new, now)
                found[fmt][0].append(changed + at)
                found[fmt][1].append(new[changed])
    return {f: (torch.cat(i), torch.cat(r)) for f, (i, r) in found.items()}


def changed_among(
    ckpt: Path, base: Any, formats: list[str], where: tuple[list[int], dict[str, Any]],
    ref: Parts, touched: Sequence[np.ndarray], meta: Any,
) -> Parts:  # fmt: skip
    """:func:`changed_rows` on each table's ``touched`` rows only: the checkpoint's gathered
    from its mapped storage (:func:`rows_at`), the served ones from the base's mapped file,
    the chain's ``ref`` rows over them; a row no pass touched cannot differ from what serves."""
    local, sections = where
    if len(touched) != len(SPARSE_NAMES):
        raise DeltaError(f"{len(touched)} tables' touched rows for {len(SPARSE_NAMES)} tables")
    found: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {
        f: ([], []) for f in sections
    }
    served = np.memmap(base.tables_path, np.uint8, mode="r")
    for t, feature in enumerate(SPARSE_NAMES):
        ids = np.asarray(touched[t], dtype=np.int64)
        if not len(ids):
            continue
        fmt, width = formats[t], row_bytes(base.dim, formats[t])
        key = f"{CHECKPOINT_PREFIX}{EBC}.{table_name(feature)}.weight"
        new = pack(rows_at(ckpt, key, ids, meta), fmt)
        at = local[t] + ids  # rows within the format's section
        first, n = sections[fmt]
        now = torch.from_numpy(served[first : first + n * width].reshape(n, width)[at])
        ref_ids, ref_rows = ref.get(fmt) or (torch.empty(0, dtype=torch.int64), None)
        if len(ref_ids):  # rows the chain already replaced: compare with those
            assert ref_rows is not None
            known = ref_ids.numpy()
            pos = np.minimum(np.searchsorted(known, at), len(known) - 1)
            hit = np.flatnonzero(known[pos] == at)
            now[torch.from_numpy(hit)] = ref_rows[torch.from_numpy(pos[hit])]
        changed = differing_rows(new, now)
        found[fmt][0].append(torch.from_numpy(at)[changed])
        found[fmt][1].append(new[changed])
    del served
    empty = torch.empty(0, dtype=torch.int64)
    return {f: (torch.cat(i) if i else empty,
                torch.cat(r) if r else torch.empty(0, row_bytes(base.dim, f), dtype=torch.uint8))
            for f, (i, r) in found.items()}  # fmt: skip


def make_delta(
    ckpt: Path, model_cfg: Any, export: Path, folder: Path, version: str, fmt: str = "int8",
    touched: Sequence[np.ndarray] | None = None,
) -> tuple[dict[str, Any], Any, Any]:  # fmt: skip
    """Write ``ckpt``'s delta over ``folder``'s chain on ``export``'s ``fmt`` tables (int8,
    int4 or mixed: the variant the workers serve); returns (its record: file, sha256, format,
    bytes, rows, row_bytes, dense_bytes, seconds; the scorer serving now; the candidate's).
    ``touched``: :func:`changed_rows`' (None: every row compared)."""
    if fmt not in DELTA_FORMATS:
        raise DeltaError(f"deltas are made of {'/'.join(DELTA_FORMATS)} tables, not {fmt}")
    t0 = time.perf_counter()
    base_v = base_version(export)
    if folder.name != base_v:
        raise DeltaError(f"{folder} is not the deltas folder of {export} (version {base_v})")
    folder.mkdir(parents=True, exist_ok=True)
    mapped = export / mapped_name(fmt)
    if not mapped.is_file():
        raise DeltaError(f"{export} has no {mapped.name}: the served {fmt} tables are not there")
    base = load_mapped(mapped, torch.device("cpu"), verify=False)
    record = torch.load(mapped, map_location="cpu", weights_only=True)["tables"]
    ref, ref_weights, parent = chain_state(folder)
    now = base if ref_weights is None else overlay(base, ref, ref_weights, parent)
    t1 = time.perf_counter()
    parts = changed_rows(ckpt, base, record, ref, touched)
    diff_s = time.perf_counter() - t1
    scorer = dense_scorer(ckpt, model_cfg)
    weights = {k: v for k, v in scorer.state_dict().items() if k != "weight"}
    delta = {"base": base_v, "base_sha256": record["sha256"], "parent": parent,
             "version": version, "format": fmt, "dim": base.dim, **as_file(parts, fmt),
             "weights": weights, "checkpoint": str(ckpt)}  # fmt: skip
    seq = len(read_pointer(folder)["chain"]) + 1
    out = write_delta(folder / f"{seq:04d}-{version}.pt", delta)
    candidate = overlay(base, merge_parts(ref, parts), weights, version)
    dense = sum(v.numel() * v.element_size() for v in weights.values())
    widths = {f: row_bytes(base.dim, f) for f in parts}
    out.update(row_bytes=widths.get(fmt, widths), dense_bytes=dense, parent=parent, chain=seq,
               seconds=round(time.perf_counter() - t0, 2), diff_s=round(diff_s, 2))  # fmt: skip
    return out, now, candidate


def gate(now: Any, candidate: Any, arrays: Any, out: Path) -> dict[str, Any]:
    """Both scorers' probabilities on ``arrays`` (rows the candidate never trained on) into
    ``out`` (``.npz``: ``labels``, ``default``, ``candidate``), what ``serving.tools.deltas
    publish`` judges by the rollout's rules (its margin, the near-chance refusal); the gate's
    record: the file, rows, both AUCs."""
    from recsys_stack.metrics import roc_auc
    from training.export.parity import predict

    y = np.asarray(arrays.labels)
    p_now, p_cand = (np.asarray(predict(m, arrays)) for m in (now, candidate))
    with open(out, "wb") as f:  # a file object: np.savez names it exactly so
        np.savez(f, labels=y, default=p_now, candidate=p_cand)
    return {"judge": str(out), "eval_rows": len(arrays), "auc_default": roc_auc(y, p_now),
            "auc_candidate": roc_auc(y, p_cand)}  # fmt: skip


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
    p.add_argument(
        "--format",
        choices=DELTA_FORMATS,
        help="the served tables' (default: the base export's CPU variant)",
    )
    p.add_argument("--unseen-data", type=Path, help="rows to gate on (never trained on)")
    p.add_argument("--eval-rows", type=int, default=20_000)
    a = p.parse_args(argv)
    ckpt = a.checkpoint or checkpoint.read_latest(a.run_dir / "checkpoints")
    if ckpt is None:
        print(f"error: {a.run_dir} has no checkpoint", file=sys.stderr)
        return 2
    cfg = config_from_dict(checkpoint.read_meta(ckpt)["config"])
    try:
        fmt = a.format or served_format(json.loads((a.base / "schema.json").read_text()))[0]
        if fmt is None:
            raise DeltaError(served_format(json.loads((a.base / "schema.json").read_text()))[1])
        record, now, candidate = make_delta(ckpt, cfg.model, a.base, a.deltas, a.version, fmt)
    except (DeltaError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.unseen_data is not None:
        judge = a.deltas / f"{Path(record['file']).stem}.judge.npz"
        record["gate"] = gate(now, candidate, unseen_arrays(a.unseen_data, cfg, a.eval_rows),
                              judge)  # fmt: skip
    print(json.dumps(record), flush=True)  # a caller may read it before this process ends
    return 0


if __name__ == "__main__":
    sys.exit(main())
