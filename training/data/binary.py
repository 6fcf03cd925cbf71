"""Parse Criteo TSV once into ``.npy`` arrays that later epochs memory-map.

A preprocessed directory holds ``labels.npy`` (``int8[N]``), ``dense.npy`` (``float32[N, 13]``,
raw ints), ``sparse.npy`` (``int64[N, 26]``, ``MISSING_ID`` for empty), optionally ``prob.npy``
(``float32[N]``, true click probabilities of synthetic data) and ``meta.json``. It is built in a
temporary sibling directory and renamed into place, so a killed run leaves no half dataset.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from training.data.criteo import CriteoReader, OnBad, ParseReport, resolve_data_paths
from training.data.synthetic import prob_sidecar
from training.errors import DataError, RecsysError
from training.features import NUM_DENSE, NUM_SPARSE

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# name -> (dtype, trailing shape)
ARRAYS: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
    "labels": (np.dtype(np.int8), ()),
    "dense": (np.dtype(np.float32), (NUM_DENSE,)),
    "sparse": (np.dtype(np.int64), (NUM_SPARSE,)),
    "prob": (np.dtype(np.float32), ()),
}


@dataclass
class BinaryMeta:
    """Contents of ``meta.json``."""

    rows: int
    inputs: list[dict[str, Any]]  # per TSV: path, size, mtime_ns, prob (sidecar's or None)
    parse_report: dict[str, Any]  # ParseReport.to_dict()
    has_prob: bool
    format_version: int = FORMAT_VERSION

    @property
    def report(self) -> ParseReport:
        """The parse report of the preprocessing run."""
        return ParseReport.from_dict(self.parse_report)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BinaryMeta:
        """Inverse of :meth:`to_dict`; raises ``KeyError`` / ``TypeError`` on a bad dict."""
        return cls(
            rows=int(data["rows"]),
            inputs=list(data["inputs"]),
            parse_report=dict(data["parse_report"]),
            has_prob=bool(data["has_prob"]),
            format_version=int(data["format_version"]),
        )


@dataclass
class BinaryArrays:
    """A loaded dataset (``N`` rows); arrays are read-only memory maps when ``mmap=True``."""

    labels: np.ndarray  # int8[N]
    dense: np.ndarray  # float32[N, 13]
    sparse: np.ndarray  # int64[N, 26]
    prob: np.ndarray | None  # float32[N] or None
    meta: BinaryMeta

    def __len__(self) -> int:
        return len(self.labels)


def _stat(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def fingerprint(files: Sequence[Path]) -> list[dict[str, Any]]:
    """Identity of input files (and their prob sidecars): resolved path, size, mtime."""
    out = []
    for f in files:
        sidecar = prob_sidecar(f)
        prob = _stat(sidecar) if sidecar.is_file() else None
        out.append({"path": str(f.resolve()), **_stat(f), "prob": prob})
    return out


def _write_npy(raw: Path, dest: Path, name: str, rows: int) -> None:
    """Prefix the raw bytes of ``name`` with an ``.npy`` header (streamed, constant memory)."""
    dtype, tail = ARRAYS[name]
    header = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": (rows, *tail),
    }
    with dest.open("wb") as out, raw.open("rb") as src:
        np.lib.format.write_array_header_1_0(out, header)
        shutil.copyfileobj(src, out, 1 << 22)
    raw.unlink()


def _load_sidecars(files: Sequence[Path]) -> list[np.ndarray] | None:
    """Every file's prob sidecar, or None unless all exist and load."""
    probs = []
    for f in files:
        sidecar = prob_sidecar(f)
        if not sidecar.is_file():
            return None
        try:
            probs.append(np.load(sidecar, mmap_mode="r"))
        except (ValueError, OSError, EOFError) as e:
            log.warning("ignoring unreadable prob sidecar %s: %s", sidecar, e)
            return None
    return probs


def preprocess(
    paths: Sequence[Path | str],
    out_dir: Path,
    *,
    on_bad: OnBad = "skip",
    max_bad_rows: int = 1000,
    progress: bool = True,
    chunk_rows: int = 65536,
) -> BinaryMeta:
    """Parse ``paths`` (files or directories) into ``out_dir``, replacing what was there.

    ``prob.npy`` is written when every input has a ``<name>.prob.npy`` sidecar with one entry
    per data line; entries of skipped malformed rows are dropped with their rows.
    Raises :class:`DataError` per the ``on_bad`` policy, or when no row is well-formed.
    """
    files = [p for path in paths for p in resolve_data_paths(path)]
    inputs = fingerprint(files)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        log.info("removing stale temporary directory %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        reader = CriteoReader(
            files,
            on_bad=on_bad,
            max_bad_rows=max_bad_rows,
            chunk_rows=chunk_rows,
            progress=progress,
        )
        rows, has_prob = _write_raw(reader, files, tmp)
        if rows == 0:
            raise DataError(
                f"no well-formed rows in {', '.join(map(str, files))}: {reader.report.summary()}"
            )
        for name in (
            ("labels", "dense", "sparse", "prob") if has_prob else ("labels", "dense", "sparse")
        ):
            _write_npy(tmp / f"{name}.bin", tmp / f"{name}.npy", name, rows)
        meta = BinaryMeta(
            rows=rows, inputs=inputs, parse_report=reader.report.to_dict(), has_prob=has_prob
        )
        (tmp / "meta.json").write_text(json.dumps(meta.to_dict(), indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("preprocessed %d rows into %s (%s)", rows, out_dir, reader.report.summary())
    return meta


def _write_raw(reader: CriteoReader, files: Sequence[Path], tmp: Path) -> tuple[int, bool]:
    """Stream every chunk to ``tmp/<name>.bin``; returns (rows, whether prob.bin is valid)."""
    probs = _load_sidecars(files)
    by_file = dict(zip(files, probs, strict=True)) if probs is not None else {}
    has_prob = probs is not None
    rows = 0
    handles: dict[str, BinaryIO] = {name: (tmp / f"{name}.bin").open("wb") for name in ARRAYS}
    try:
        for chunk in reader:
            handles["labels"].write(chunk.labels.tobytes())
            handles["dense"].write(chunk.dense.tobytes())
            handles["sparse"].write(chunk.sparse.tobytes())
            rows += len(chunk)
            if not has_prob:
                continue
            prob = by_file[chunk.path]
            if chunk.line_numbers[-1] > len(prob):
                has_prob = False
                continue
            handles["prob"].write(np.asarray(prob[chunk.line_numbers - 1], np.float32).tobytes())
    finally:
        for h in handles.values():
            h.close()
    for f in files if has_prob else ():
        if reader.file_rows.get(f) != len(by_file[f]):
            has_prob = False
    if probs is not None and not has_prob:
        log.warning("prob sidecars do not match the data line counts; not writing prob.npy")
    return rows, has_prob


def _load_array(path: Path, name: str, rows: int, mmap: bool) -> np.ndarray:
    """One array, checked against its expected dtype and shape."""
    dtype, tail = ARRAYS[name]
    hint = f"delete {path.parent} and preprocess again"
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise DataError(f"{path}: missing from the preprocessed dataset; {hint}") from None
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: corrupt or truncated ({e}); {hint}") from None
    if arr.dtype != dtype or arr.shape != (rows, *tail):
        raise DataError(
            f"{path}: expected {dtype}{[rows, *tail]}, found {arr.dtype}{list(arr.shape)}; {hint}"
        )
    return arr


def load_binary(out_dir: Path, mmap: bool = True) -> BinaryArrays:
    """Open a preprocessed directory; raises :class:`DataError` naming any bad file."""
    out_dir = Path(out_dir)
    meta_path = out_dir / "meta.json"
    try:
        meta = BinaryMeta.from_dict(json.loads(meta_path.read_text()))
    except FileNotFoundError:
        raise DataError(f"{meta_path}: missing; {out_dir} is not a preprocessed dataset") from None
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(
            f"{meta_path}: unreadable ({e}); delete {out_dir} and preprocess again"
        ) from None
    if meta.format_version != FORMAT_VERSION:
        raise DataError(
            f"{meta_path}: format version {meta.format_version}, this code reads {FORMAT_VERSION}; "
            f"delete {out_dir} and preprocess again"
        )
    arrays = {
        name: _load_array(out_dir / f"{name}.npy", name, meta.rows, mmap)
        for name in ARRAYS
        if name != "prob" or meta.has_prob
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


def ensure_binary(
    paths: Sequence[Path | str],
    cache_root: Path,
    *,
    on_bad: OnBad = "skip",
    max_bad_rows: int = 1000,
    progress: bool = True,
) -> tuple[Path, BinaryMeta]:
    """Preprocessed copy of ``paths`` under ``cache_root``, reused while the inputs are unchanged.

    The cache directory is ``cache_root/criteo-<hash of resolved paths, sizes and mtimes>``, so
    editing an input makes a new one (old ones stay until deleted). A reused dataset is held to
    ``on_bad`` / ``max_bad_rows`` through its stored parse report. Not safe for concurrent
    callers: call it on one rank, then synchronize.
    """
    files = [p for path in paths for p in resolve_data_paths(path)]
    inputs = fingerprint(files)
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, inputs], sort_keys=True).encode()).hexdigest()
    out_dir = Path(cache_root) / f"criteo-{key[:16]}"
    if (out_dir / "meta.json").is_file():
        try:
            meta = load_binary(out_dir).meta
        except DataError as e:
            log.warning("rebuilding invalid cache: %s", e)
        else:
            if meta.inputs == inputs:
                _check_policy(meta.report, on_bad, max_bad_rows)
                log.info("reusing preprocessed data %s (%d rows)", out_dir, meta.rows)
                return out_dir, meta
    meta = preprocess(files, out_dir, on_bad=on_bad, max_bad_rows=max_bad_rows, progress=progress)
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
        "--on-bad", choices=["skip", "fail"], default="skip", help="malformed rows (default skip)"
    )
    p.add_argument(
        "--max-bad-rows", type=int, default=1000, help="skip at most this many (default 1000)"
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        meta = preprocess(
            args.inputs,
            args.out,
            on_bad=args.on_bad,
            max_bad_rows=args.max_bad_rows,
            progress=not args.no_progress,
        )
    except RecsysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {meta.report.summary()}" + (" (with prob.npy)" if meta.has_prob else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
