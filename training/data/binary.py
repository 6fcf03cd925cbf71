"""The binary cache of Criteo TSV: find or build it, and open it as memory-mapped arrays.

A preprocessed directory holds ``labels.npy``, ``dense.npy``, ``sparse.npy`` (dtypes, id
hashing and cache keys: :mod:`training.data.layout`), optionally ``prob.npy`` (``float32[N]``,
true click probabilities of synthetic data) and ``meta.json``. :func:`preprocess` builds one
(in parallel, resumable: :mod:`training.data.build`); :func:`ensure_binary` finds the cache of
some inputs and table sizes or builds it; :func:`load_binary` opens one, checking every array
against ``meta.json`` and the format version.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.data.build import fingerprint, locked, preprocess
from training.data.criteo import OnBad, ParseReport, resolve_data_paths
from training.data.layout import (
    FORMAT_VERSION,
    TRAILING,
    BinaryMeta,
    array_dtypes,
    cache_key,
    legacy_key,
)
from training.errors import DataError, RecsysError

log = logging.getLogger(__name__)

__all__ = [
    "BinaryArrays",
    "BinaryMeta",
    "ensure_binary",
    "fingerprint",
    "load_binary",
    "preprocess",
]


@dataclass
class BinaryArrays:
    """A loaded dataset (``N`` rows); arrays are read-only memory maps when ``mmap=True``."""

    labels: np.ndarray  # int8[N]
    dense: np.ndarray  # float32[N, 13]
    sparse: np.ndarray  # [N, 26] hashed ids (meta.rows_per_table) or raw int64 ids; -1 missing
    prob: np.ndarray | None  # float32[N] or None
    meta: BinaryMeta

    def __len__(self) -> int:
        return len(self.labels)


def _load_array(path: Path, dtype: np.dtype, shape: tuple[int, ...], mmap: bool) -> np.ndarray:
    """One array, checked against its expected dtype and shape."""
    hint = f"delete {path.parent} and preprocess again"
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise DataError(f"{path}: missing from the preprocessed dataset; {hint}") from None
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: corrupt or truncated ({e}); {hint}") from None
    if arr.dtype != dtype or arr.shape != shape:
        raise DataError(
            f"{path}: expected {dtype}{list(shape)}, found {arr.dtype}{list(arr.shape)}; {hint}"
        )
    return arr


def read_meta(out_dir: Path) -> BinaryMeta:
    """``meta.json`` of a format-:data:`FORMAT_VERSION` cache; :class:`DataError` otherwise."""
    meta_path = out_dir / "meta.json"
    try:
        raw = json.loads(meta_path.read_text())
        version = int(raw["format_version"])
        if version != FORMAT_VERSION:
            raise DataError(
                f"{meta_path}: cache format {version}, this code reads {FORMAT_VERSION}; "
                f"delete {out_dir} and preprocess again"
            )
        meta = BinaryMeta.from_dict(raw)
    except FileNotFoundError:
        raise DataError(f"{meta_path}: missing; {out_dir} is not a preprocessed dataset") from None
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{meta_path}: unreadable ({e}); delete {out_dir} and preprocess again"
        ) from None
    expected = {k: str(v) for k, v in array_dtypes(meta.rows_per_table, meta.has_prob).items()}
    if meta.dtypes != expected:
        raise DataError(
            f"{meta_path}: arrays {meta.dtypes}, format {FORMAT_VERSION} has {expected}"
        )
    return meta


def load_binary(out_dir: Path, mmap: bool = True) -> BinaryArrays:
    """Open a preprocessed directory; raises :class:`DataError` naming any bad file."""
    out_dir = Path(out_dir)
    meta = read_meta(out_dir)
    arrays = {
        name: _load_array(
            out_dir / f"{name}.npy", np.dtype(dtype), (meta.rows, *TRAILING[name]), mmap
        )
        for name, dtype in meta.dtypes.items()
    }
    return BinaryArrays(
        arrays["labels"], arrays["dense"], arrays["sparse"], arrays.get("prob"), meta
    )


def _check_policy(report: ParseReport, on_bad: OnBad, max_bad_rows: int) -> None:
    """Apply the malformed-row policy to a cached dataset's report."""
    if report.rows_bad and on_bad == "fail":
        raise DataError(
            f"{report.examples[0]} (on_bad='fail'; use on_bad='skip' to drop malformed rows)"
        )
    if report.rows_bad > max_bad_rows:
        raise DataError(
            f"{report.rows_bad} malformed rows, more than max_bad_rows={max_bad_rows}; "
            f"first: {report.examples[0]}; fix the data or raise max_bad_rows"
        )


def _reusable(out_dir: Path, inputs: list[dict[str, Any]]) -> BinaryMeta | None:
    """The cache at ``out_dir`` if it holds ``inputs`` in this format; else None (a cache
    that is there but unusable is named in one log line)."""
    meta_path = out_dir / "meta.json"
    if not meta_path.is_file():
        return None
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        version = int(json.loads(meta_path.read_text()).get("format_version"))
        if version != FORMAT_VERSION:
            log.info("rebuilding %s: cache format %d, this code writes %d", out_dir, version,
                     FORMAT_VERSION)  # fmt: skip
            return None
    try:
        meta = load_binary(out_dir).meta
    except DataError as e:
        log.warning("rebuilding the cache: %s", e)
        return None
    return meta if meta.inputs == inputs else None


def cache_path(
    inputs: list[dict[str, Any]], cache_root: Path, rows_per_table: Sequence[int] | None
) -> Path:
    """Where :func:`ensure_binary` keeps the cache of ``inputs`` (their :func:`fingerprint`)."""
    return Path(cache_root) / f"criteo-{cache_key(inputs, rows_per_table)[:16]}"


def reusable(out_dir: Path, inputs: list[dict[str, Any]]) -> bool:
    """Whether ``out_dir`` holds a complete cache of ``inputs`` that this code reads."""
    return _reusable(out_dir, inputs) is not None


def ensure_binary(
    paths: Sequence[Path | str],
    cache_root: Path,
    *,
    on_bad: OnBad = "skip",
    max_bad_rows: int = 1000,
    progress: bool = True,
    rows_per_table: Sequence[int] | None = None,
    processes: int = 0,
) -> tuple[Path, BinaryMeta]:
    """Preprocessed copy of ``paths`` under ``cache_root``, reused while nothing it depends on
    changed: ``cache_root/criteo-<hash>`` (:func:`training.data.layout.cache_key`: the inputs'
    resolved paths and content fingerprints, table sizes and the id hash). A reused dataset is
    held to ``on_bad`` / ``max_bad_rows`` through its stored parse report. Concurrent callers
    wait for the first one to build it, then reuse it.
    """
    files = [p for path in paths for p in resolve_data_paths(path)]
    inputs = fingerprint(files)
    out_dir = cache_path(inputs, cache_root, rows_per_table)
    with locked(out_dir):
        meta = _reusable(out_dir, inputs)
        if meta is not None:
            _check_policy(meta.report, on_bad, max_bad_rows)
            log.info("reusing preprocessed data %s (%d rows)", out_dir, meta.rows)
            return out_dir, meta
        legacy = Path(cache_root) / f"criteo-{legacy_key(inputs)[:16]}"
        if (legacy / "meta.json").is_file():
            log.info("replacing the format-1 cache %s (raw int64 ids) with %s", legacy, out_dir)
        meta = preprocess(
            files, out_dir, on_bad=on_bad, max_bad_rows=max_bad_rows, progress=progress,
            rows_per_table=rows_per_table, processes=processes,
        )  # fmt: skip
        shutil.rmtree(legacy, ignore_errors=True)
    return out_dir, meta


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m training.data.binary``: preprocess TSV files and print the parse report."""
    p = argparse.ArgumentParser(
        prog="python -m training.data.binary",
        description="Parse Criteo TSV (files or directories of *.tsv / day_<n>) into .npy arrays.",
    )
    p.add_argument("inputs", type=Path, nargs="+", help="TSV files or directories")
    p.add_argument("--out", type=Path, required=True, help="output directory (replaced)")
    p.add_argument(
        "--tables", type=int, nargs="+", metavar="ROWS",
        help="rows per table, one for all 26 or 26 values: ids stored hashed (default: raw)",
    )  # fmt: skip
    p.add_argument("--processes", type=int, default=0, help="worker processes (default: cores)")
    p.add_argument(
        "--on-bad", choices=["skip", "fail"], default="skip", help="malformed rows (default skip)"
    )
    p.add_argument(
        "--max-bad-rows", type=int, default=1000, help="skip at most this many (default 1000)"
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tables = args.tables
    if tables is not None and len(tables) == 1:
        tables = tables * 26
    if tables is not None and (len(tables) != 26 or min(tables) < 1):
        p.error("--tables takes one positive number or 26")
    t0 = time.perf_counter()
    try:
        meta = preprocess(
            args.inputs,
            args.out,
            on_bad=args.on_bad,
            max_bad_rows=args.max_bad_rows,
            progress=not args.no_progress,
            rows_per_table=tables,
            processes=args.processes,
        )
    except RecsysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - t0
    print(
        f"{args.out}: {meta.report.summary()}" + (" (with prob.npy)" if meta.has_prob else "")
        + f"; {meta.rows / seconds:,.0f} rows/s, {meta.bytes_per_row()} bytes/row"
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
