"""The data a model was trained and evaluated on, as its export records it (``schema.json``
``"data"``), and the check that a file on disk is still that data.

The export writes the record (training/export/pipeline.py); ``make score``, ``make evaluate``
and ``make rollout`` default to its held-out rows (serving/tools/evaldata.py)::

    "data": {
      "files": [{"path": "/abs/data/synthetic/synthetic_r20000_v100_s0.tsv", "bytes": 2873311,
                 "sha256_ends": "9f2c..."}],
      "rows": 20000,          the well-formed rows the trainer read, files in order
      "skipped_rows": 0,      malformed rows it skipped (data.on_bad_row = "skip")
      "eval_fraction": 0.1,   data.eval_fraction
      "eval_rows": 2000       the held-out split: the last eval_rows of the rows
    }

A file's **fingerprint** is its size and the sha256 of its first and last MiB (one hash over
both): cheap on a 45 GB Criteo file, and it tells a replaced or regenerated-differently file
apart (another size, other first or last rows), while a copy or an identical regeneration
(another mtime, same bytes) still matches. It is also the identity of a file everywhere else
its content matters: the preprocessing cache's key (training/data/build.py), the files the
continuous loop consumed (training/continuous/inbox.py). What it reads: 2 MiB a file at most
(the whole of a file up to that size), so a 1.3 TB Criteo folder of 24 days costs 48 MiB of
reads per start; what it misses: a change of the same size confined to the middle.

:func:`natural_key` is the one file order of the project (``day_2`` before ``day_10``).
Standard library only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENDS = 1 << 20  # bytes hashed at each end of a file


class DataMismatch(ValueError):
    """The recorded data is missing, or a file on disk is not what was recorded (one line)."""


def sha256_ends(path: Path, size: int) -> str:
    """sha256 of the first :data:`ENDS` bytes and of the last ones (the whole of a small file)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        h.update(f.read(ENDS))
        if size > ENDS:
            f.seek(max(ENDS, size - ENDS))
            h.update(f.read(ENDS))
    return h.hexdigest()


def natural_key(name: str) -> list[Any]:
    """Sort key of a file name with its digit runs as numbers: ``day_2`` before ``day_10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def fingerprint(path: Path) -> dict[str, Any]:
    """``{"path", "bytes", "sha256_ends"}`` of an existing file (``path`` resolved)."""
    path = Path(path).resolve()
    size = path.stat().st_size
    return {"path": str(path), "bytes": size, "sha256_ends": sha256_ends(path, size)}


def record(
    files: Sequence[Path], rows: int, skipped_rows: int, eval_fraction: float, eval_rows: int
) -> dict[str, Any]:
    """The schema's ``"data"`` entry; a file missing now is recorded with its path only."""
    prints = [
        fingerprint(f) if Path(f).is_file() else {"path": str(Path(f).resolve())} for f in files
    ]
    return {"files": prints, "rows": rows, "skipped_rows": skipped_rows,
            "eval_fraction": eval_fraction, "eval_rows": eval_rows}  # fmt: skip


def shown(path: Path | str) -> str:
    """``path`` relative to the working directory when it is under it (as a user typed it)."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def check(data: dict[str, Any] | None, who: str) -> list[Path]:
    """The files of ``data`` (a schema's record; ``who``: the model, for messages), each on
    disk with its recorded fingerprint; :class:`DataMismatch` (one line) otherwise."""
    if not data or not data.get("files"):
        raise DataMismatch(f"{who}'s schema.json records no training data (re-export it)")
    out = []
    for entry in data["files"]:
        path = Path(entry["path"])
        if not path.is_file():
            raise DataMismatch(f"{who} was trained on {shown(path)}, which is missing")
        if "bytes" not in entry:
            raise DataMismatch(f"{who}'s data {shown(path)} was missing when it was exported")
        now = fingerprint(path)
        if (now["bytes"], now["sha256_ends"]) != (entry["bytes"], entry["sha256_ends"]):
            raise DataMismatch(
                f"{shown(path)} is not the file {who} was trained on ({now['bytes']} bytes, "
                f"sha256 of its ends {now['sha256_ends'][:12]}; recorded {entry['bytes']} "
                f"bytes, {entry['sha256_ends'][:12]})"
            )
        out.append(path)
    return out


def heldout(data: dict[str, Any]) -> tuple[int | None, int]:
    """``(first row, count)`` of the held-out split among the files' non-empty lines; the
    first row is None when malformed rows were skipped (count the lines to place it)."""
    count = int(data["eval_rows"])
    first = int(data["rows"]) - count if not data.get("skipped_rows") else None
    return first, count
