"""Validate and convert Criteo TSV fields in bulk: byte lookup tables over a joined buffer.

:func:`convert_block` decodes every field of a block of 40-field lines at once with numpy byte
gathers (no per-field Python objects) and flags the rows that fail; ``recsys_stack.criteo_rows.diagnose`` (the rules the serving
tools read by) re-examines one flagged row to name its first bad column. The two must agree (a row flagged by the fast path
and passed by ``diagnose`` is reported as a parser bug). Shapes: ``N`` lines in a block.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from recsys_stack.criteo_rows import MAX_DEC_DIGITS, MAX_HEX_DIGITS, NUM_FIELDS
from training.features import MISSING_ID, NUM_DENSE

_INT64_MAX = np.uint64(2**63 - 1)

# Byte lookup tables: the digit's value, or a code for '-' / anything invalid (NUL included).
_MINUS, _INVALID = 253, 255
_HEX_LUT = np.full(256, _INVALID, np.uint8)
_DEC_LUT = np.full(256, _INVALID, np.uint8)
for _i, _c in enumerate(b"0123456789"):
    _HEX_LUT[_c] = _DEC_LUT[_c] = _i
for _i, _c in enumerate(b"abcdef"):
    _HEX_LUT[_c] = _HEX_LUT[_c - 32] = 10 + _i
_DEC_LUT[ord("-")] = _MINUS


def _field_bytes(
    buf: np.ndarray, starts: np.ndarray, lens: np.ndarray, lut: np.ndarray, max_len: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """For ``k < max_len``: (``bool[...]`` field has a k-th byte, its ``lut`` code ``uint8[...]``)."""
    last = len(buf) - 1
    for k in range(min(int(lens.max(initial=0)), max_len)):
        present = lens > k
        yield present, lut[buf[np.minimum(starts + k, last)]]


def _parse_hex(
    buf: np.ndarray, starts: np.ndarray, lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Hex fields at ``starts``/``lens`` -> ``int64[...]`` (empty -> MISSING_ID), bad mask."""
    bad = lens > MAX_HEX_DIGITS
    acc = np.zeros(starts.shape, np.uint64)
    for present, code in _field_bytes(buf, starts, lens, _HEX_LUT, MAX_HEX_DIGITS):
        bad |= present & (code >= 16)
        acc = np.where(present, acc * np.uint64(16) + (code & 15), acc)
    bad |= acc > _INT64_MAX
    out = acc.astype(np.int64)
    out[lens == 0] = MISSING_ID
    return out, bad


def _parse_dec(
    buf: np.ndarray, starts: np.ndarray, lens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integer fields -> ``int64[...]`` (empty -> 0) and a bad mask; '-' only leads."""
    neg = (lens > 0) & (buf[np.minimum(starts, len(buf) - 1)] == ord("-"))
    digits = lens - neg
    bad = (digits > MAX_DEC_DIGITS) | (neg & (digits == 0))
    acc = np.zeros(starts.shape, np.int64)
    for k, (present, code) in enumerate(
        _field_bytes(buf, starts, lens, _DEC_LUT, MAX_DEC_DIGITS + 1)
    ):
        digit = present & (code < 10)
        bad |= present & ~(digit | neg if k == 0 else digit)
        acc = np.where(digit, acc * 10 + (code & 15), acc)
    return np.where(neg, -acc, acc), bad


def convert_block(lines: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``N`` lines of 40 fields -> (labels, dense, sparse, ``bool[N]`` bad-row mask).

    The lines are joined with TABs into one buffer, so field ``j`` of row ``i`` is field
    ``40 * i + j`` of the buffer; every field is then decoded by byte gathers, no per-field objects.
    """
    n = len(lines)
    buf = np.frombuffer(b"\t".join(lines), dtype=np.uint8)
    tabs = np.flatnonzero(buf == ord("\t"))
    starts = np.concatenate(([0], tabs + 1)).reshape(n, NUM_FIELDS)
    ends = np.concatenate((tabs, [len(buf)])).reshape(n, NUM_FIELDS)
    lens = ends - starts
    first = buf[np.minimum(starts[:, 0], len(buf) - 1)]
    bad = (lens[:, 0] != 1) | ((first != ord("0")) & (first != ord("1")))
    dense, dense_bad = _parse_dec(buf, starts[:, 1 : 1 + NUM_DENSE], lens[:, 1 : 1 + NUM_DENSE])
    sparse, sparse_bad = _parse_hex(buf, starts[:, 1 + NUM_DENSE :], lens[:, 1 + NUM_DENSE :])
    bad |= dense_bad.any(axis=1) | sparse_bad.any(axis=1)
    return (first == ord("1")).astype(np.int8), dense.astype(np.float32), sparse, bad
