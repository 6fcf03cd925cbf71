"""Packed protobuf varints -> numpy arrays: the ids and lengths of a ``ScoreRequest``.

The request's ids are the bulk of its bytes (a 1,000-example request of 26 features: ~130 KB of
varints). :func:`varints` decodes them with a fixed number of array operations whatever the mix
of sizes, the same values as protobuf (tests/serving/test_wire.py compares them). This is the
fallback of the gateway's C walk (``serving.gateway._fastwire``, built wherever there is a
compiler): it has to be right, not as fast. :func:`read_varint` reads a single varint (a tag, a
length).
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np

# varints(): zero bytes after the data, so that the 8-byte word read at the last varints' first
# byte (and the 2 more bytes of a 10-byte one) stay inside the array
_WINDOW = np.zeros(10, np.uint8)
_PAD = _WINDOW.tobytes()
# (shift, bits kept in place, bits moved down): 2 x 7 bits per 16, then 2 x 14 per 32, then
# 2 x 28 per 64: a word's eight 7-bit groups become one 56-bit number
_PACK = [
    (np.uint64(s), np.uint64(keep), np.uint64(high))
    for s, keep, high in (
        (1, 0x007F007F007F007F, 0x3F803F803F803F80),
        (2, 0x00003FFF00003FFF, 0x0FFFC0000FFFC000),
        (4, 0x000000000FFFFFFF, 0x00FFFFFFF0000000),
    )
]
# by varint size: the bits its own bytes carry (9 and 10 bytes: the first 8 here, the rest apart)
_LOW = np.array([0] + [(1 << 7 * k) - 1 for k in range(1, 9)] + [(1 << 56) - 1] * 2, np.uint64)


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """One varint at ``pos`` -> (value, next position); IndexError/ValueError if malformed."""
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def varints(data: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Packed varints ``u8[n]`` -> (values as u64 two's complement, index of each one's last
    byte); None when the bytes do not end on a complete varint or one is over 10 bytes.

    A fixed number of array operations whatever the mix of sizes: the 8 bytes from each
    varint's first byte are read as one little-endian u64 (:data:`_WINDOW` padding covers the
    last ones), their 7-bit groups are packed together in three shift-and-mask steps (pairs,
    quads, the whole word; fewer when every varint is short), and the bytes past each varint's
    own end are masked off; the rare 9- and 10-byte ones (ids >= 2^56, negative ids) take
    their last bits from two more gathers. Per byte, only one comparison runs."""
    if data.size == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    last = np.flatnonzero(data < 0x80)
    if last.size == data.size:  # every value < 128: the common case for lengths
        return data.astype(np.uint64), last
    values = _unpack(np.concatenate((data, _WINDOW)), last, data.size)
    return None if values is None else (values, last)


def _unpack(padded: np.ndarray, last: np.ndarray, n: int) -> np.ndarray | None:
    """:func:`varints` of the first ``n`` bytes of ``padded`` (not all single bytes; then
    :data:`_WINDOW`'s zeros) whose varints end at ``last``: the values, or None when
    malformed."""
    if last.size == 0 or last[-1] != n - 1:
        return None
    sizes = np.empty_like(last)  # of each varint; then where each starts
    sizes[0] = last[0] + 1
    np.subtract(last[1:], last[:-1], out=sizes[1:])
    starts = last - sizes
    starts += 1
    longest = int(sizes.max())
    if longest > 10:
        return None
    # an unaligned little-endian u64 starting at every byte (a view: nothing is copied)
    words = np.ndarray((n,), "<u8", padded, 0, (1,))
    x = words.take(starts)
    y = np.empty_like(x)
    for step, (shift, keep, high) in enumerate(_PACK):
        if longest <= 1 << step:
            break
        np.right_shift(x, shift, out=y)
        y &= high
        x &= keep
        x |= y
    x &= _LOW.take(sizes, out=y)
    if longest > 8:
        long = np.flatnonzero(sizes > 8)
        at = starts[long]
        x[long] |= (padded[at + 8] & 0x7F).astype(np.uint64) << np.uint64(56)
        tenth = (padded[at + 9] & 1).astype(np.uint64) * (sizes[long] == 10)
        x[long] |= tenth << np.uint64(63)
    return x


def decode_fields(fields: list[bytes | memoryview]) -> tuple[np.ndarray, np.ndarray] | None:
    """Several packed-varint fields -> (values i64, values per field); None when a field does
    not end on a complete varint or holds one over 10 bytes; one vectorized pass whatever the
    size."""
    raw = b"".join([*fields, _PAD])  # the zeros the vectorized pass reads past the end
    n = len(raw) - len(_PAD)
    if raw.isascii():  # every value < 128 (lengths, as a rule): nothing to decode
        sizes = np.fromiter(map(len, fields), np.int64, len(fields))
        return np.frombuffer(raw, np.uint8, n).astype(np.int64), sizes
    if any(f[-1] >= 0x80 for f in fields if len(f)):
        return None  # a field's last byte continues a varint: malformed on its own
    padded = np.frombuffer(raw, np.uint8)
    last = np.flatnonzero(padded[:n] < 0x80)
    values = _unpack(padded, last, n)
    if values is None:
        return None
    ends = np.fromiter(accumulate(map(len, fields)), np.int64, len(fields))
    ends -= 1
    per_field = np.searchsorted(last, ends, side="right")
    per_field[1:] -= per_field[:-1].copy()
    return values.view(np.int64), per_field
