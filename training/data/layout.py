"""The binary cache's format: what each array holds, in which dtype, and what keys a cache.

Format 2 (this code) stores, per well-formed row: ``labels`` ``int8``, ``dense`` ``float32[13]``
(the raw integers; the model's ``log1p`` runs at batch time) and ``sparse`` ``[26]`` holding
each id already hashed into its table (``id mod rows``, :func:`training.features.hash_ids`, the
function export bakes into the served model), ``MISSING_ID`` (-1) for an empty field, in the
narrowest signed integer that holds every table's rows (``int32`` for Criteo's sizes): 157 bytes
a row for Criteo Kaggle, where format 1 stored raw ``int64`` ids (261). A cache built without
table sizes keeps raw ``int64`` ids (``rows_per_table`` = None). ``float16`` dense was measured
and rejected as not lossless: on 3M synthetic Kaggle-shaped rows 1.3e-6 of the values change
(those above 2048; |log1p difference| up to 4.8e-4), and Criteo's counts reach the millions,
past float16's 65504 (infinite).

A cache is keyed by its inputs, its table sizes and :func:`id_hash_tag`, the behaviour of the
hash on fixed probes, so a change of either builds a new cache instead of reusing one.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from training.data.criteo import ParseReport
from training.features import MISSING_ID, NUM_DENSE, NUM_SPARSE, hash_ids

FORMAT_VERSION = 2
NPY_HEADER = 128  # bytes before the data of every array (numpy's own header, padded)
DENSE_DTYPE = np.dtype(np.float32)
_ID_DTYPES = [(np.dtype(f"int{8 * n}"), 2 ** (8 * n - 1) - 1) for n in (1, 2, 4, 8)]
# Ids spread over the int64 range, and table sizes from 1 row to the int32 limit.
_PROBE_IDS = [0, 1, 2, 3, 7, 127, 128, 255, 65535, 2**31 - 1, 2**31, 2**32 + 5, 2**40 + 3]
_PROBE_IDS += [0x68FD1E64, 0xDEADBEEF, 2**62 + 7, 2**63 - 1]
_PROBE_ROWS = [1, 2, 3, 10, 97, 128, 1000, 2048, 65536, 10_131_227, 2**31 - 1]


def id_dtype(rows_per_table: Sequence[int] | None) -> np.dtype:
    """Narrowest signed integer holding ``0 .. rows - 1`` of every table (and -1); ``int64``
    for raw ids."""
    if rows_per_table is None:
        return np.dtype(np.int64)
    top = max(rows_per_table) - 1
    return next(dtype for dtype, most in _ID_DTYPES if top <= most)


def array_dtypes(rows_per_table: Sequence[int] | None, has_prob: bool) -> dict[str, np.dtype]:
    """``{array name: dtype}`` of a cache (``prob``: synthetic data's true probabilities)."""
    out: dict[str, np.dtype] = {
        "labels": np.dtype(np.int8),
        "dense": DENSE_DTYPE,
        "sparse": id_dtype(rows_per_table),
    }
    if has_prob:
        out["prob"] = np.dtype(np.float32)
    return out


TRAILING = {"labels": (), "dense": (NUM_DENSE,), "sparse": (NUM_SPARSE,), "prob": ()}


def id_hash_tag() -> str:
    """What the id hash does, as a short digest of :func:`hash_ids` on fixed probe ids and
    table sizes: a changed hash changes the tag, hence the cache key."""
    ids = torch.tensor(_PROBE_IDS, dtype=torch.int64)[:, None]
    rows = torch.tensor(_PROBE_ROWS, dtype=torch.int64)[None, :]
    out = hash_ids(ids, rows).to(torch.int64).numpy()
    return "mod-" + hashlib.sha256(out.tobytes()).hexdigest()[:16]


def store_ids(
    sparse: np.ndarray, rows_per_table: Sequence[int] | None, dtype: np.dtype
) -> np.ndarray:
    """Raw ids ``int64[N, 26]`` (negative = missing) -> what the cache stores: each id's row in
    its table (:func:`hash_ids`, called here and nowhere else at preprocessing), missing kept as
    ``MISSING_ID``, in ``dtype``. Raw ids stay as they are without table sizes."""
    if rows_per_table is None:
        return sparse
    rows = torch.tensor(list(rows_per_table), dtype=torch.int64)
    hashed = hash_ids(torch.from_numpy(sparse), rows).numpy()
    return np.where(sparse < 0, MISSING_ID, hashed).astype(dtype)


def cache_key(inputs: list[dict[str, Any]], rows_per_table: Sequence[int] | None) -> str:
    """Hex key of a cache: its inputs' fingerprint, table sizes and id hash (not the format
    version: an older format at the same key is rebuilt in place, with a log line)."""
    tables = None if rows_per_table is None else [int(r) for r in rows_per_table]
    tag = None if tables is None else id_hash_tag()
    what = {"inputs": inputs, "rows_per_table": tables, "id_hash": tag}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def legacy_key(inputs: list[dict[str, Any]]) -> str:
    """Key of a format-1 cache of ``inputs`` (raw int64 ids), found to be replaced."""
    return hashlib.sha256(json.dumps([1, inputs], sort_keys=True).encode()).hexdigest()


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """numpy's ``.npy`` 1.0 header for ``dtype[shape]``, exactly :data:`NPY_HEADER` bytes."""
    buf = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
    np.lib.format.write_array_header_1_0(buf, {**header, "shape": shape})
    out = buf.getvalue()
    if len(out) != NPY_HEADER:  # numpy pads to 64 bytes; ours are ~90 before padding
        raise AssertionError(f".npy header of {len(out)} bytes for {shape}")
    return out


@dataclass
class BinaryMeta:
    """Contents of ``meta.json``."""

    rows: int
    inputs: list[dict[str, Any]]  # per TSV: path, bytes, sha256_ends, prob (sidecar's or None)
    parse_report: dict[str, Any]  # ParseReport.to_dict()
    has_prob: bool
    rows_per_table: list[int] | None  # tables the ids were hashed into; None = raw ids
    id_hash: str | None  # id_hash_tag() when hashed
    dtypes: dict[str, str]  # array name -> dtype name
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
        tables = data["rows_per_table"]
        return cls(
            rows=int(data["rows"]),
            inputs=list(data["inputs"]),
            parse_report=dict(data["parse_report"]),
            has_prob=bool(data["has_prob"]),
            rows_per_table=None if tables is None else [int(r) for r in tables],
            id_hash=data["id_hash"],
            dtypes={str(k): str(v) for k, v in data["dtypes"].items()},
            format_version=int(data["format_version"]),
        )

    def bytes_per_row(self) -> int:
        """Bytes of one row over the arrays (prob included when present)."""
        return sum(np.dtype(d).itemsize * int(np.prod(TRAILING[n])) for n, d in self.dtypes.items())
