"""The data a model was trained and evaluated on, as its export records it (``schema.json``
``"data"``), and the check that a file on disk is still that data.

The export writes the record (training/export/record.py); ``make score``, ``make evaluate``
and ``make rollout`` default to its **unseen** rows, those the model never trained on
(serving/tools/evaldata.py)::

    "data": {
      "files": [{"path": "/abs/data/synthetic/synthetic_r20000_v100_s0.tsv", "bytes": 2873311,
                 "sha256_ends": "9f2c..."}],
      "rows": 20000,          the well-formed rows the trainer read, files in order
      "skipped_rows": 0,      malformed rows it skipped (data.on_bad_row = "skip")
      "eval_fraction": 0.1,   data.eval_fraction
      "eval_rows": 2000,      the held-out rows: the last eval_rows of the rows (0: none)
      "valid_fraction": 0.5,  data.valid_fraction (runs with three splits)
      "valid_rows": 1000,     the validation split: the first of the held-out rows
      "test_rows": 1000,      the test split: the last test_rows of the rows
      "unseen": {             rows the model never trained on (null: none known)
        "files": [...],       fingerprints, as "files"
        "first_row": 18000,   0-based, among the files' non-empty lines (null: the last "rows")
        "rows": 2000,
        "at_end": true,       the rows end where the files end (found from the end)
        "why": "its held-out split, ..."
      },
      "trained_files": [...]  continuous training: every file it trained on (name, bytes,
    }                         sha256_ends), so another model's rows can be told seen or not

A batch run's unseen rows are its test split (the held-out rows after its validation rows,
which chose its checkpoint and early stopping: figures on them would be flattered), or its
whole held-out split when it had no test split; a continuous run's are the file that arrived
after the checkpoint, scored before any model trained on it. A record written before
``unseen`` existed gives its held-out split (:func:`unseen`).

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


def prints(files: Sequence[Path]) -> list[dict[str, Any]]:
    """Each file's :func:`fingerprint`; a file missing now is recorded with its path only."""
    return [
        fingerprint(f) if Path(f).is_file() else {"path": str(Path(f).resolve())} for f in files
    ]


def record(
    files: Sequence[Path], rows: int, skipped_rows: int, eval_fraction: float, eval_rows: int,
    test_rows: int | None = None, valid_fraction: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The schema's ``"data"`` entry, its test split (the last ``test_rows``; without one, its
    held-out split, the last ``eval_rows``) as its ``unseen`` rows (none when ``eval_rows``
    is 0)."""
    data = {"files": prints(files), "rows": rows, "skipped_rows": skipped_rows,
            "eval_fraction": eval_fraction, "eval_rows": eval_rows}  # fmt: skip
    if test_rows is not None and eval_rows:
        data.update(valid_fraction=valid_fraction, valid_rows=eval_rows - test_rows,
                    test_rows=test_rows)  # fmt: skip
    data["unseen"] = heldout_split(data) if eval_rows else None
    return data


def unseen_entry(
    files: Sequence[Path], first_row: int | None, rows: int, why: str
) -> dict[str, Any]:
    """A ``data.unseen`` entry: ``rows`` rows of ``files`` from ``first_row`` (0-based; None:
    the last ``rows``) that the model never trained on, and ``why`` it never did."""
    at_end = first_row is None  # counted from the end of the files, else from the first row
    return {"files": prints(files), "first_row": first_row, "rows": rows, "at_end": at_end,
            "why": why}  # fmt: skip


def heldout_split(data: dict[str, Any]) -> dict[str, Any]:
    """The test split of a record (its last ``test_rows``), or of a record without one its
    held-out split (its last ``eval_rows``), as an ``unseen`` entry."""
    first, count = heldout(data)
    fraction = data.get("eval_fraction")
    why = f"its held-out split, the last {count} rows (data.eval_fraction {fraction})"
    if "test_rows" in data:
        count = int(data["test_rows"])
        first = None if first is None else first + int(data["eval_rows"]) - count
        why = (f"its test split, the last {count} rows (data.eval_fraction {fraction}, "
               f"data.valid_fraction {data.get('valid_fraction')}): no training decision saw "
               f"them (the {data.get('valid_rows')} validation rows before them chose the "
               "checkpoint)")  # fmt: skip
    return {"files": data["files"], "first_row": first, "rows": count, "at_end": True, "why": why}


def unseen(data: dict[str, Any]) -> dict[str, Any] | None:
    """The rows a record says its model never trained on: its ``unseen`` entry (None: none
    known), or in a record written before that entry, its held-out split."""
    if "unseen" in data:
        found: dict[str, Any] | None = data["unseen"]
        return found
    return heldout_split(data)


def shown(path: Path | str) -> str:
    """``path`` relative to the working directory when it is under it (as a user typed it)."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


def check(data: dict[str, Any] | None, who: str, role: str = "{who} was trained on") -> list[Path]:
    """The files of ``data`` (a schema's record or its ``unseen`` entry; ``who``: the model,
    ``role``: what the files are to it, for messages, e.g. ``{who}'s unseen rows are in``),
    each on disk with its recorded fingerprint; :class:`DataMismatch` (one line) otherwise."""
    role = role.format(who=who)
    if not data or not data.get("files"):
        raise DataMismatch(f"{who}'s schema.json records no training data (re-export it)")
    out = []
    for entry in data["files"]:
        path = Path(entry["path"])
        if not path.is_file():
            raise DataMismatch(f"{role} {shown(path)}, which is missing")
        if "bytes" not in entry:
            raise DataMismatch(f"{who}'s data {shown(path)} was missing when it was exported")
        if not same(fingerprint(path), entry):
            now = fingerprint(path)
            raise DataMismatch(
                f"{shown(path)} is not the file {role} ({now['bytes']} bytes, "
                f"sha256 of its ends {now['sha256_ends'][:12]}; recorded {entry['bytes']} "
                f"bytes, {entry['sha256_ends'][:12]})"
            )
        out.append(path)
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two fingerprints (or ledger contents) are of the same bytes."""
    return (a.get("bytes"), a.get("sha256_ends")) == (b.get("bytes"), b.get("sha256_ends"))


def heldout(data: dict[str, Any]) -> tuple[int | None, int]:
    """``(first row, count)`` of the held-out split among the files' non-empty lines; the
    first row is None when malformed rows were skipped (count the lines to place it)."""
    count = int(data["eval_rows"])
    first = int(data["rows"]) - count if not data.get("skipped_rows") else None
    return first, count
