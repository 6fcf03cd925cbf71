"""Embedding deltas: the rows a pass changed, applied over the mapped tables without a re-export.

A **delta** (``docs/contracts.md``) is one ``torch.save`` file, written by the training side
(``python -m training.export.delta``) and read by every serving worker:

* ``base`` (the ``.mar`` version it applies to) and ``base_sha256`` (its table file's
  checksum), ``parent`` (the label of the delta before it in the chain, ``""`` for the first)
  and ``version`` (its own label);
* ``format``, ``dim`` and ``ids``: sorted, unique global row ids ``int64[n]`` (rows of the
  concatenated tables, as in ``tables_<fmt>.bin``), ``rows``: their bytes ``uint8[n, W]``,
  packed by :func:`recsys_model.mapped.pack` exactly as the export packs them;
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
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from pathlib import Path
from typing import Any

import torch

try:  # inside a TorchServe worker the archive's files sit side by side
    from atomic import write_atomic  # type: ignore[import-not-found]
    from mapped import MappedScorer, _bag, row_bytes  # type: ignore[import-not-found]
except ImportError:
    from recsys_model.atomic import write_atomic
    from recsys_model.mapped import MappedScorer, _bag, row_bytes

DELTA_FORMATS = ("int8", "int4")  # the overlay pools with the rowwise kernels' weights
POINTER = "current.json"  # the chain a deltas folder serves (replaced by rename)


class DeltaError(ValueError):
    """A delta that cannot be applied (corrupt, of another base, out of order)."""


def write_delta(path: Path, delta: dict[str, Any]) -> dict[str, Any]:
    """``delta`` (module doc) into ``path`` (written aside, then renamed in); its record for
    the pointer: file, sha256, bytes, rows, version."""
    buf = io.BytesIO()
    torch.save(delta, buf)
    data = buf.getvalue()
    write_atomic(path, data)
    return {"file": path.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "rows": int(delta["ids"].numel()), "version": delta["version"]}  # fmt: skip


def read_delta(path: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """The delta of a pointer's chain ``entry`` (its file beside the pointer), checked against
    the entry's sha256 and its own shapes. Raises :class:`DeltaError` naming the file."""
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
    ids, rows = delta.get("ids"), delta.get("rows")
    if not isinstance(ids, torch.Tensor) or not isinstance(rows, torch.Tensor):
        raise DeltaError(f"{path}: no ids/rows tensors")
    width = row_bytes(int(delta["dim"]), str(delta["format"]))
    if ids.dtype != torch.int64 or rows.dtype != torch.uint8 or rows.shape != (ids.numel(), width):
        raise DeltaError(f"{path}: ids {tuple(ids.shape)} / rows {tuple(rows.shape)} do not fit")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise DeltaError(f"{path}: ids are not sorted and unique")
    if delta.get("version") != entry.get("version"):
        raise DeltaError(f"{path}: holds {delta.get('version')}, its pointer says {entry}")
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


class OverlayScorer(MappedScorer):
    """A :class:`MappedScorer` over another's mapping (``base``: kept alive, its descriptor
    with it) with its own dense weights and the overlay rows ``ov_ids``/``ov_rows``."""

    base: MappedScorer
    ov_ids: torch.Tensor
    ov_rows: torch.Tensor
    label: str = ""

    def pooled(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The base's rows, with each id the overlay holds taken from the overlay instead:
        one bag over the base with weight 0 on those ids, plus one over the overlay's rows."""
        self.check_tables()
        fmt, grid, _, _ = self.sections[0]
        ids, _ = self.global_ids(values, lengths)
        pos = torch.searchsorted(self.ov_ids, ids).clamp_(max=max(self.ov_ids.numel() - 1, 0))
        hit = self.ov_ids[pos] == ids if self.ov_ids.numel() else ids < 0
        if not bool(hit.any()):
            out = _bag(fmt, grid, ids, lengths)
        else:
            w = hit.float()
            out = _bag(fmt, grid, ids, lengths, 1.0 - w)
            out = out + _bag(fmt, self.ov_rows, torch.where(hit, pos, 0), lengths, w)
        return self.unflatten(out, lengths.shape[1])


def overlay(
    base: MappedScorer,
    ids: torch.Tensor,
    rows: torch.Tensor,
    weights: dict[str, torch.Tensor],
    label: str,
) -> OverlayScorer:
    """A scorer serving ``base``'s mapping with ``rows`` at ``ids`` and ``weights`` as its
    dense part (no copy of the tables). Raises :class:`DeltaError` for a file deltas cannot
    overlay (fp16/fp32/mixed tables, a format or width other than the delta's)."""
    if len(base.sections) != 1 or base.sections[0][0] not in DELTA_FORMATS:
        raise DeltaError("deltas apply to uniform int8/int4 mapped tables: export a full version")
    fmt, grid, _, _ = base.sections[0]
    if rows.shape[1:] != grid.shape[1:] or (ids.numel() and int(ids[-1]) >= grid.shape[0]):
        raise DeltaError(f"delta rows {tuple(rows.shape)} do not fit the {fmt} tables "
                         f"{tuple(grid.shape)}")  # fmt: skip
    with torch.device("meta"):
        model = OverlayScorer(base.spec)
    model.load_state_dict(weights, strict=False, assign=True)
    model.weight, model.sections, model.routes = base.weight, base.sections, base.routes
    model.tables_path, model.tables_fd = base.tables_path, base.tables_fd
    model.tables_seen = base.tables_seen
    object.__setattr__(model, "base", base)  # kept alive, not a submodule (no state_dict)
    model.ov_ids, model.ov_rows, model.label = ids, rows, label
    return model.eval()


def read_pointer(folder: Path) -> dict[str, Any]:
    """``folder``'s chain (``{"base", "version", "chain": [records]}``; none yet: empty)."""
    path = folder / POINTER
    if not path.exists():
        return {"base": folder.name, "version": "", "chain": []}
    pointer: dict[str, Any] = json.loads(path.read_text())
    return pointer


def write_pointer(folder: Path, chain: list[dict[str, Any]]) -> dict[str, Any]:
    """Point ``folder``'s workers at ``chain`` (written aside, renamed in: a worker reads the
    old pointer or the new one, never half); the pointer written."""
    pointer = {"base": folder.name, "version": chain[-1]["version"] if chain else "",
               "chain": chain, "time": time.time()}  # fmt: skip
    write_atomic(folder / POINTER, json.dumps(pointer, indent=1))
    return pointer


def chain_state(folder: Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any] | None, str]:
    """The overlay ``folder``'s pointer serves: merged ids, rows, the last dense weights (None:
    the base's) and its label (``""``: the base)."""
    ids, rows = torch.empty(0, dtype=torch.int64), torch.empty(0, 0, dtype=torch.uint8)
    weights, label = None, ""
    for entry in read_pointer(folder)["chain"]:
        delta = read_delta(folder / entry["file"], entry)
        ids, rows = merge(ids, rows, delta["ids"], delta["rows"])
        weights, label = delta["weights"], delta["version"]
    return ids, rows, weights, label
