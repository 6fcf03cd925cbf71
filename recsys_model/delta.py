"""Embedding deltas: the rows a pass changed, applied over the mapped tables without a re-export.

A **delta** (``docs/contracts.md``) is one ``torch.save`` file, written by the training side
(``python -m training.export.delta``) and read by every serving worker:

* ``base`` (the ``.mar`` version it applies to) and ``base_sha256`` (its table file's
  checksum), ``parent`` (the label of the delta before it in the chain, ``""`` for the first)
  and ``version`` (its own label);
* ``format``, ``dim`` and ``ids``: sorted, unique global row ids ``int64[n]`` (rows of the
  concatenated tables, as in ``tables_<fmt>.bin``), ``rows``: their bytes ``uint8[n, W]``,
  packed by :func:`recsys_model.mapped.pack` exactly as the export packs them; a ``mixed``
  file's delta has ``parts`` instead: ``{section format: {"ids", "rows"}}``, the ids rows of
  that section of the file (each table's first row in its section added, as a lookup does);
* ``weights``: the dense part (every weight but the tables), as ``mapped_<fmt>.pt`` holds it.

Its checksum (sha256 of the file) is in the chain's pointer (``current.json``, replaced by
rename) and checked before anything is applied: a truncated, corrupt or foreign delta is
refused and the version serving stays.

**Applied as an overlay.** The mapped table file stays as the export wrote it (one copy per
host in the page cache, shared by every worker); each worker keeps the chain's changed rows,
merged (later deltas win), as a small packed tensor with its sorted ids. A lookup pools the
mapping's rows with the overlaid ones weighted 0 and the overlay's own rows weighted 1 (two
kernel calls, only for a batch that touches an overlaid row), so the pooled sums are those of
the full export of the same checkpoint up to float addition order. An :class:`OverlayScorer`
is immutable once built: a worker swaps the one it serves by a single reference assignment
and each batch scores with the one it took at its start (never a mix). Compaction is a full
export (a new ``.mar``, a new mapped file by rename) that starts an empty chain.

**The pointer** is read-modify-written under an ``fcntl`` lock on ``current.json.lock`` beside
it (:func:`update_pointer`: a publish racing a rollback cannot lose one) and carries its write
``time``, strictly later than the one it replaced: a worker's acknowledgement names that time
and the chain's last file and checksum, so an ack written before the pointer moved is never
taken for one of the new pointer (serving/tools/deltas.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

try:  # inside a TorchServe worker the archive's files sit side by side
    from atomic import write_atomic  # type: ignore[import-not-found]
    from mapped import MappedScorer, _bag, row_bytes  # type: ignore[import-not-found]
except ImportError:
    from recsys_model.atomic import write_atomic
    from recsys_model.mapped import MappedScorer, _bag, row_bytes

DELTA_FORMATS = ("int8", "int4", "mixed")  # mapped tables a delta overlays (by section)
POINTER = "current.json"  # the chain a deltas folder serves (replaced by rename)
LOCK = "current.json.lock"  # held while the pointer is read, changed and written
Parts = dict[str, tuple[torch.Tensor, torch.Tensor]]  # section format -> (sorted ids, rows)


class DeltaError(ValueError):
    """A delta that cannot be applied (corrupt, of another base, out of order)."""


def write_delta(path: Path, delta: dict[str, Any]) -> dict[str, Any]:
    """``delta`` (module doc) into ``path`` (written aside, then renamed in); its record for
    the pointer: file, sha256, bytes, rows, version."""
    buf = io.BytesIO()
    torch.save(delta, buf)
    data = buf.getvalue()
    write_atomic(path, data)
    rows = sum(int(p["ids"].numel()) for p in delta.get("parts", {}).values())
    return {"file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "rows": rows if "parts" in delta else int(delta["ids"].numel()),
            "version": delta["version"], "format": delta["format"]}  # fmt: skip


def as_file(parts: Parts, fmt: str) -> dict[str, Any]:
    """A delta file's row fields for ``parts`` (module doc): ``ids``/``rows`` for a uniform
    ``fmt``, ``parts`` for ``mixed``."""
    if fmt != "mixed":
        ids, rows = parts[fmt]
        return {"ids": ids, "rows": rows}
    return {"parts": {f: {"ids": i, "rows": r} for f, (i, r) in parts.items()}}


def read_delta(path: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """The delta of a pointer's chain ``entry`` (its file beside the pointer), checked against
    the entry's sha256 and its own shapes; its rows as ``delta["parts"]`` (:data:`Parts`,
    one section for a uniform file). Raises :class:`DeltaError` naming the file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DeltaError(f"{path}: cannot be read ({e})") from None
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
        raise DeltaError(f"{path}: checksum differs from its pointer's (partial or replaced)")
    try:
        delta: dict[str, Any] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # any unpickling failure: one line naming the file
        raise DeltaError(f"{path}: not a delta file ({type(e).__name__}: {e})") from None
    raw = delta.get("parts")
    if not isinstance(raw, dict):
        raw = {str(delta.get("format")): {"ids": delta.get("ids"), "rows": delta.get("rows")}}
    parts: Parts = {}
    for fmt, part in raw.items():
        ids, rows = part.get("ids"), part.get("rows")
        if not isinstance(ids, torch.Tensor) or not isinstance(rows, torch.Tensor):
            raise DeltaError(f"{path}: no ids/rows tensors")
        width = row_bytes(int(delta["dim"]), fmt)
        if (
            ids.dtype != torch.int64
            or rows.dtype != torch.uint8
            or rows.shape != (ids.numel(), width)
        ):
            raise DeltaError(f"{path}: ids {tuple(ids.shape)} / rows {tuple(rows.shape)} do not "
                             f"fit")  # fmt: skip
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise DeltaError(f"{path}: ids are not sorted and unique")
        parts[fmt] = (ids, rows)
    if delta.get("version") != entry.get("version"):
        raise DeltaError(f"{path}: holds {delta.get('version')}, its pointer says {entry}")
    delta["parts"] = parts
    return delta


def merge(
    ids: torch.Tensor, rows: torch.Tensor, new_ids: torch.Tensor, new_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two overlays ``(sorted ids int64[n], rows uint8[n, W])`` -> one, ``new`` winning."""
    if ids.numel() == 0:
        return new_ids, new_rows
    keep = ~torch.isin(ids, new_ids)
    all_ids = torch.cat([ids[keep], new_ids])
    order = torch.argsort(all_ids)
    return all_ids[order].contiguous(), torch.cat([rows[keep], new_rows])[order].contiguous()


def merge_parts(old: Parts, new: Parts) -> Parts:
    """:func:`merge` section by section, ``new`` winning."""
    out = dict(old)
    for fmt, (ids, rows) in new.items():
        out[fmt] = merge(*old[fmt], ids, rows) if fmt in old else (ids, rows)
    return out


def _overlaid(fmt: str, grid: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor,
              part: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:  # fmt: skip
    """:func:`_bag` of ``grid``'s rows ``ids``, each id ``part`` holds taken from ``part``."""
    if part is None or part[0].numel() == 0:
        return _bag(fmt, grid, ids, lengths)
    ov_ids, ov_rows = part
    pos = torch.searchsorted(ov_ids, ids).clamp_(max=ov_ids.numel() - 1)
    hit = ov_ids[pos] == ids
    if not bool(hit.any()):
        return _bag(fmt, grid, ids, lengths)
    w = hit.float()
    out = _bag(fmt, grid, ids, lengths, 1.0 - w)
    return out + _bag(fmt, ov_rows, torch.where(hit, pos, 0), lengths, w)


class OverlayScorer(MappedScorer):
    """A :class:`MappedScorer` over another's mapping (``base``: kept alive, its descriptor
    with it) with its own dense weights and the overlay rows ``parts`` (per section)."""

    base: MappedScorer
    parts: Parts
    label: str = ""

    def pooled(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The base's rows, with each id the overlay holds taken from the overlay instead:
        per section, one bag over the base with weight 0 on those ids, plus one over the
        overlay's rows (as :meth:`MappedScorer.pooled`, one call per section)."""
        self.check_tables()
        batch = lengths.shape[1]
        ids, per_feature = self.global_ids(values, lengths)
        if len(self.sections) == 1:
            fmt, grid, _, _ = self.sections[0]
            return self.unflatten(_overlaid(fmt, grid, ids, lengths, self.parts.get(fmt)), batch)
        which = torch.repeat_interleave(self.routes[0], per_feature)
        out = torch.empty(self.num_features, batch, self.dim)
        for k, (fmt, grid, feats, _) in enumerate(self.sections):
            got = _overlaid(fmt, grid, ids[which == k], lengths[feats], self.parts.get(fmt))
            out[feats] = got.view(-1, batch, self.dim)
        return out.transpose(0, 1)


def overlay(
    base: MappedScorer, parts: Parts, weights: dict[str, torch.Tensor], label: str
) -> OverlayScorer:
    """A scorer serving ``base``'s mapping with ``parts``' rows over its sections and
    ``weights`` as its dense part (no copy of the tables). Raises :class:`DeltaError` for a
    file deltas cannot overlay (uniform fp16/fp32 tables) or rows that do not fit it."""
    if not base.sections:
        raise DeltaError("deltas apply to int8/int4/mixed mapped tables: export a full version")
    grids = {fmt: grid for fmt, grid, _, _ in base.sections}
    for fmt, (ids, rows) in parts.items():
        grid = grids.get(fmt)
        if (
            grid is None
            or rows.shape[1:] != grid.shape[1:]
            or (ids.numel() and int(ids[-1]) >= grid.shape[0])
        ):
            shape = None if grid is None else tuple(grid.shape)
            raise DeltaError(f"delta {fmt} rows {tuple(rows.shape)} do not fit the tables "
                             f"({'/'.join(grids)}; {fmt}: {shape})")  # fmt: skip
    with torch.device("meta"):
        model = OverlayScorer(base.spec)
    model.load_state_dict(weights, strict=False, assign=True)
    model.weight, model.sections, model.routes = base.weight, base.sections, base.routes
    model.tables_path, model.tables_fd = base.tables_path, base.tables_fd
    model.tables_seen = base.tables_seen
    object.__setattr__(model, "base", base)  # kept alive, not a submodule (no state_dict)
    model.parts, model.label = parts, label
    return model.eval()


def read_pointer(folder: Path) -> dict[str, Any]:
    """``folder``'s chain (``{"base", "version", "chain": [records], "time"}``; none yet:
    empty, time 0)."""
    path = folder / POINTER
    if not path.exists():
        return {"base": folder.name, "version": "", "chain": [], "time": 0.0}
    pointer: dict[str, Any] = json.loads(path.read_text())
    return pointer


@contextlib.contextmanager
def pointer_lock(folder: Path) -> Iterator[None]:
    """Held while ``folder``'s pointer is read, changed and written (``fcntl.flock`` on
    :data:`LOCK` beside it: released when the process dies)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def update_pointer(
    folder: Path, change: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Under :func:`pointer_lock`: the chain ``folder`` points at -> ``change(chain)``, written
    aside and renamed in (a worker reads the old pointer or the new one, never half), its
    ``time`` later than the old one's. ``(the old chain, the pointer written)``; ``change``
    may raise to leave it as it is."""
    with pointer_lock(folder):
        old = read_pointer(folder)
        chain = change(list(old["chain"]))
        stamp = max(time.time(), float(old.get("time", 0.0)) + 1e-6)
        pointer = {"base": folder.name, "version": chain[-1]["version"] if chain else "",
                   "chain": chain, "time": stamp}  # fmt: skip
        write_atomic(folder / POINTER, json.dumps(pointer, indent=1))
    return old["chain"], pointer


def write_pointer(folder: Path, chain: list[dict[str, Any]]) -> dict[str, Any]:
    """Point ``folder``'s workers at ``chain`` (:func:`update_pointer`); the pointer written."""
    return update_pointer(folder, lambda _: chain)[1]


def chain_state(folder: Path) -> tuple[Parts, dict[str, Any] | None, str]:
    """The overlay ``folder``'s pointer serves: merged rows per section, the last dense weights
    (None: the base's) and its label (``""``: the base)."""
    parts: Parts = {}
    weights, label = None, ""
    for entry in read_pointer(folder)["chain"]:
        delta = read_delta(folder / entry["file"], entry)
        parts = merge_parts(parts, delta["parts"])
        weights, label = delta["weights"], delta["version"]
    return parts, weights, label
