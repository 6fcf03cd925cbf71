"""``recsys.v1.ScoreRequest`` bytes -> the model's arrays, without a Python object per value.

protobuf's Python message hands repeated fields out one Python object per element (a request
of 1,000 examples x 64 ids x 26 features is 1.7 million ints); this module reads the canonical
encoding directly: the packed ``dense`` floats are one ``np.frombuffer``, and the packed varints
of every feature's ``ids`` and ``lengths`` are gathered into one byte array each and decoded in
one vectorized pass (:func:`varints`). Python only walks the ~30 fields of the message.

Anything but the canonical encoding that protobuf writers emit (unpacked repeated fields, unknown
fields, fields split in several pieces, a truncated or malformed buffer) returns ``None``, and
the caller takes protobuf's own parser instead: this module is a fast path with protobuf as its
reference, never a second opinion on what is valid (tests compare both on random and fuzzed
requests).

Work is bounded by the schema before any loop can run long: more ``sparse`` entries than the
model has features is INVALID_ARGUMENT the moment the one too many is seen (a 4 MB request of
two million empty features once cost 4.6 s of CPU here), on the fast path and before protobuf's
objects are walked on the slow one. Shapes: ``B`` examples, ``D`` dense, ``F`` sparse features, ``N`` ids.
"""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError

from serving.gateway.validate import (
    Columns,
    InvalidRequest,
    Limits,
    Schema,
    check_feature_count,
    columns,
    validate_columns,
)
from serving.stubs import ranker_pb2
from serving.worker.codec import Arrays

# tags: (field number << 3) | wire type (0 = varint, 2 = length-delimited)
NUM_EXAMPLES, DENSE, SPARSE, MODEL_VERSION = 0x08, 0x12, 0x1A, 0x22
NAME, IDS, LENGTHS = 0x0A, 0x12, 0x1A

Parsed = tuple[int, np.ndarray, list[tuple[str, bytes | memoryview, bytes | memoryview]], str]


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
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
    byte); None when the bytes do not end on a complete varint or one is over 10 bytes."""
    if data.size == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    last = np.flatnonzero(data < 0x80)
    if last.size == 0 or last[-1] != data.size - 1:
        return None
    starts = np.empty_like(last)
    starts[0] = 0
    starts[1:] = last[:-1] + 1
    sizes = last - starts + 1
    if int(sizes.max()) > 10:
        return None
    if int(sizes.max()) == 1:  # every value < 128: the common case for lengths
        return data.astype(np.uint64), last
    shift = (np.arange(data.size) - np.repeat(starts, sizes)).astype(np.uint64) * np.uint64(7)
    return np.add.reduceat((data & 0x7F).astype(np.uint64) << shift, starts), last


def parse(buf: bytes, max_features: int | None = None) -> Parsed | None:
    """Top level of a canonically encoded ScoreRequest: (num_examples, dense f32 view, [(name,
    ids bytes, lengths bytes)] in request order, model_version); None = not canonical. Raises
    :class:`InvalidRequest` at the first ``sparse`` entry beyond ``max_features``."""
    try:
        return _parse(buf, max_features)
    except InvalidRequest:
        raise
    except (IndexError, ValueError, UnicodeDecodeError):
        return None


def _bound_fields(buf: bytes, max_features: int, max_fields: int) -> None:
    """Before protobuf builds an object per field of a non-canonical request: walk its top
    level (bytes skipped, not read) and refuse more ``sparse`` entries than ``max_features``
    or more fields than ``max_fields`` (what a request within the limits can need, each
    value in a field of its own). Malformed bytes stop the walk: protobuf names the error."""
    pos, end, fields, sparse = 0, len(buf), 0, 0
    try:
        while pos < end:
            tag, pos = _varint(buf, pos)
            kind = tag & 7
            if kind == 0:
                pos = _varint(buf, pos)[1]
            elif kind == 2:
                n, pos = _varint(buf, pos)
                pos += n
            elif kind in (1, 5):
                pos += 8 if kind == 1 else 4
            else:
                return  # groups: no field of ours, protobuf refuses or skips them
            fields += 1
            sparse += tag == SPARSE
            check_feature_count(sparse, max_features)
            if fields > max_fields:
                raise InvalidRequest(
                    f"the request has over {max_fields} top-level protobuf fields, more than any "
                    "request within the limits needs"
                )
    except InvalidRequest:
        raise
    except (IndexError, ValueError):
        return


def _parse(buf: bytes, max_features: int | None) -> Parsed | None:
    view = memoryview(buf)
    pos, end = 0, len(buf)
    b, version = 0, ""
    dense = np.zeros(0, np.float32)
    features: list[tuple[str, bytes | memoryview, bytes | memoryview]] = []
    seen_dense = seen_b = seen_version = False
    while pos < end:
        tag = buf[pos]
        pos += 1
        if tag == NUM_EXAMPLES and not seen_b:
            b, pos = _varint(buf, pos)
            seen_b = True
            if b >= 1 << 32:
                return None
            continue
        n, pos = _varint(buf, pos)
        if pos + n > end or tag not in (DENSE, SPARSE, MODEL_VERSION):
            return None
        if tag == DENSE and not seen_dense and n % 4 == 0:
            dense = np.frombuffer(view[pos : pos + n], dtype="<f4")
            seen_dense = True
        elif tag == SPARSE:
            check_feature_count(len(features) + 1, max_features)
            feature = _feature(buf, pos, pos + n, view)
            if feature is None:
                return None
            features.append(feature)
        elif tag == MODEL_VERSION and not seen_version:
            version = bytes(view[pos : pos + n]).decode("utf-8")
            seen_version = True
        else:
            return None
        pos += n
    return b, dense, features, version


def _feature(
    buf: bytes, pos: int, end: int, view: memoryview
) -> tuple[str, bytes | memoryview, bytes | memoryview] | None:
    """One SparseFeature: its name and the packed bytes of its ids and lengths, each field
    at most once (anything else: None)."""
    fields: dict[int, memoryview] = {}
    while pos < end:
        tag = buf[pos]
        n = buf[pos + 1]
        pos += 2
        if n >= 0x80:  # a field over 127 bytes: a longer length prefix
            n, pos = _varint(buf, pos - 1)
        if tag in fields or pos + n > end or tag not in (NAME, IDS, LENGTHS):
            return None
        fields[tag] = view[pos : pos + n]
        pos += n
    name = bytes(fields[NAME]).decode("utf-8") if NAME in fields else ""
    empty = view[0:0]
    return name, fields.get(IDS, empty), fields.get(LENGTHS, empty)


def decode_score_request(buf: bytes, schema: Schema, limits: Limits) -> tuple[Arrays, str]:
    """ScoreRequest bytes -> (the model's arrays in schema order, model_version as sent);
    raises :class:`InvalidRequest` naming what is wrong (bytes that are no ScoreRequest too)."""
    if len(buf) > limits.max_request_bytes:
        raise InvalidRequest(
            f"request is {len(buf)} bytes; the limit is {limits.max_request_bytes}"
        )
    features = len(schema.sparse)
    parsed = parse(buf, features)
    cols = None if parsed is None else _columns(parsed)
    if parsed is None or cols is None:  # not the canonical encoding: protobuf decides
        # num_examples, model_version, every feature, and every dense value in its own field
        _bound_fields(buf, features, 2 + features + limits.max_examples * len(schema.dense))
        try:
            request = ranker_pb2.ScoreRequest.FromString(buf)
        except DecodeError as e:
            raise InvalidRequest(
                f"the request is not a valid recsys.v1.ScoreRequest: {e}"
            ) from None
        return validate_columns(columns(request), schema, limits), request.model_version
    return validate_columns(cols, schema, limits), parsed[3]


def peek_examples(buf: bytes) -> int:
    """num_examples when it is the first field (as protobuf writers put it), else 0: enough
    to refuse an overload before decoding the request."""
    try:
        return _varint(buf, 1)[0] if buf[:1] == b"\x08" else 0
    except (IndexError, ValueError):
        return 0


def columns_from_bytes(buf: bytes) -> Columns | None:
    """A canonically encoded ScoreRequest as :class:`Columns`; None when the bytes are
    anything else (the caller parses them with protobuf instead)."""
    parsed = parse(buf)
    return None if parsed is None else _columns(parsed)


def _columns(parsed: Parsed) -> Columns | None:
    b, dense, features, _ = parsed
    f = len(features)
    # every feature's ids, then every feature's lengths: one vectorized decode for both (each
    # numpy call costs microseconds: for small requests the count of calls is the cost)
    decoded = _decode_fields([x[1] for x in features] + [x[2] for x in features])
    if decoded is None:
        return None
    values, per_field = decoded
    n_ids = int(per_field[:f].sum())
    signed = values.view(np.int64)
    return Columns(
        examples=b,
        dense=dense,
        names=[x[0] for x in features],
        ids=signed[:n_ids],
        ids_per_feature=per_field[:f],
        lengths=signed[n_ids:],
        entries=per_field[f:],
    )


def _decode_fields(fields: list[bytes | memoryview]) -> tuple[np.ndarray, np.ndarray] | None:
    """Several packed-varint fields, decoded in one pass -> (values u64, values per field);
    None when a field does not end on a complete varint."""
    sizes = np.fromiter((len(f) for f in fields), np.int64, len(fields))
    data = np.frombuffer(b"".join(fields), np.uint8)
    ends = np.cumsum(sizes)
    if sizes.any() and (data[ends[sizes > 0] - 1] >= 0x80).any():
        return None  # a field's last byte continues a varint: malformed on its own
    decoded = varints(data)
    if decoded is None:
        return None
    values, last = decoded
    per_field = np.diff(np.searchsorted(last, ends - 1, side="right"), prepend=0)
    return values, per_field
