"""``recsys.v1.ScoreRequest`` bytes -> the model's arrays, without a Python object per value.

protobuf's Python message hands repeated fields out one Python object per element (a request
of 1,000 examples x 64 ids x 26 features is 1.7 million ints); this module reads the canonical
encoding directly: the packed ``dense`` floats are one ``np.frombuffer``, and the packed varints
of every feature's ``ids`` and ``lengths`` are gathered into one byte array each and decoded in
one vectorized pass (``serving.gateway.varint``). Python only walks the ~30 fields of the
message. A feature's ids and lengths may each also come unpacked, one field per value (legal
protobuf, what proto2-style writers emit): the run of fields is read in one vectorized pass too
(one field per id once cost 16x the packed request, 129 ms of CPU for 3.4 MB, in protobuf's
objects).
Anything else (unknown fields, fields split in several pieces or out of order, a truncated or
malformed buffer) returns ``None``, and the caller takes protobuf's own parser instead: this
module is a fast path with protobuf as its reference, never a second opinion on what is valid
(tests compare both on random and fuzzed requests).

Work is bounded by the schema before any loop can run long: more ``sparse`` entries than the
model has features is INVALID_ARGUMENT the moment the one too many is seen (a 4 MB request of
two million empty features once cost 4.6 s of CPU here), on the fast path and before protobuf's
objects are walked on the slow one. Shapes: ``B`` examples, ``D`` dense, ``F`` sparse features, ``N`` ids.

The walk and the varints have a native twin, ``serving.gateway._fastwire`` (C, built by
``pip install`` when a compiler is there, as in the gateway's image): :func:`columns_of` takes
it when it is built, and this module's numpy path otherwise (a fallback: right, not as fast;
the C walk also runs the value checks of ``serving.gateway.validate`` that need no names, so
that a clean request skips them). Both give the same answer for every input (tests compare them
on random, crafted and fuzzed bytes).

The other messages of a call skip protobuf's objects too: :func:`score_response` writes the
``ScoreResponse`` bytes (request id included), :func:`prediction_of` slices TorchServe's answer out of its
``PredictionResponse``.
"""

from __future__ import annotations

import functools

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
from serving.gateway.varint import decode_fields, read_varint
from serving.stubs import ranker_pb2
from serving.torchserve.client import field_head, inference_pb2
from serving.worker.codec import Arrays

try:  # the native twin of parse + _columns; absent when no C compiler built it
    from serving.gateway import _fastwire
except ImportError:  # pragma: no cover - depends on the install
    _fastwire = None  # type: ignore[assignment]

# tags: (field number << 3) | wire type (0 = varint, 2 = length-delimited)
NUM_EXAMPLES, DENSE, SPARSE, MODEL_VERSION = 0x08, 0x12, 0x1A, 0x22
NAME, IDS, LENGTHS = 0x0A, 0x12, 0x1A
_FEATURE_TAGS = (NAME, IDS, LENGTHS)  # in field order, as protobuf writes them
IDS_VARINT, LENGTHS_VARINT = 0x10, 0x18  # the same fields unpacked: one varint per field
_RUN_TAGS = (-1, IDS_VARINT, LENGTHS_VARINT)

Parsed = tuple[int, np.ndarray, list[tuple[str, bytes | memoryview, bytes | memoryview]], str]
_EMPTY = memoryview(b"")


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
            tag, pos = read_varint(buf, pos)
            kind = tag & 7
            if kind == 0:
                pos = read_varint(buf, pos)[1]
            elif kind == 2:
                n, pos = read_varint(buf, pos)
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
    most = None if max_features is None else max_features + 1  # one more: validation names it
    while pos < end:
        tag = buf[pos]
        if tag == NUM_EXAMPLES and not seen_b:
            b, pos = read_varint(buf, pos + 1)
            seen_b = True
            if b >= 1 << 32:
                return None
            continue
        n = buf[pos + 1]  # the field's length: one byte, two (a feature of up to 16 KB), more
        if n < 0x80:
            pos += 2
        elif buf[pos + 2] < 0x80:
            n, pos = n & 0x7F | buf[pos + 2] << 7, pos + 3
        else:
            n, pos = read_varint(buf, pos + 1)
        stop = pos + n
        if stop > end:
            return None
        if tag == SPARSE:
            if most is not None and len(features) >= most:
                check_feature_count(len(features) + 1, max_features)
            feature = _feature(buf, pos, stop, view)
            if feature is None:
                return None
            features.append(feature)
        elif tag == DENSE and not seen_dense and n % 4 == 0:
            dense = np.frombuffer(view[pos:stop], dtype="<f4")
            seen_dense = True
        elif tag == MODEL_VERSION and not seen_version:
            version = str(view[pos:stop], "utf-8")
            seen_version = True
        else:
            return None
        pos = stop
    return b, dense, features, version


def _feature(
    buf: bytes, pos: int, end: int, view: memoryview
) -> tuple[str, bytes | memoryview, bytes | memoryview] | None:
    """One SparseFeature: its name and the packed bytes of its ids and lengths, in field
    order, each at most once (as protobuf writes them: ids and lengths each one packed field
    or a run of unpacked ones, :func:`_run`; anything else: None)."""
    found: list[bytes | memoryview] = [_EMPTY, _EMPTY, _EMPTY]  # name, ids, lengths
    for k, tag in enumerate(_FEATURE_TAGS):
        if pos < end and buf[pos] == _RUN_TAGS[k]:
            run = _run(buf, pos, end, _RUN_TAGS[k])
            if run is None:
                return None
            found[k], pos = run
        elif pos < end and buf[pos] == tag:
            n = buf[pos + 1]
            pos += 2
            if n >= 0x80:  # over 127 bytes: two bytes of length up to 16 KB, else the general case
                if buf[pos] < 0x80:
                    n = n & 0x7F | buf[pos] << 7
                    pos += 1
                else:
                    n, pos = read_varint(buf, pos - 1)
            if pos + n > end:
                return None
            found[k] = view[pos : pos + n]
            pos += n
    return (str(found[0], "utf-8"), found[1], found[2]) if pos == end else None


def _run(buf: bytes, pos: int, end: int, tag: int) -> tuple[bytes, int] | None:
    """The run of unpacked fields ``tag`` at ``pos`` (each the one-byte tag, then a varint)
    -> (their values as packed varints, the position past the run); None when a value is cut
    or longer than 10 bytes. One vectorized pass: the bytes up to ``end`` split as varints, a
    tag and a value in turn while the tags last (exact as far as the run goes, whatever comes
    after it); then the tags are dropped (a strided slice when every value is one byte, as
    lengths and small ids are)."""
    data = np.frombuffer(buf, np.uint8, end - pos, pos)
    last = np.flatnonzero(data < 0x80)  # each varint's last byte
    tags = np.empty((last.size + 1) // 2, np.int64)  # where the even varints start
    tags[:1] = 0
    np.add(last[1 : 2 * tags.size - 1 : 2], 1, out=tags[1:])
    ok = data[tags] == tag
    n = int(ok.argmin()) if not ok.all() else ok.size  # fields in the run
    if 2 * n > last.size:
        return None  # a tag whose value is cut off
    sizes = last[1 : 2 * n : 2] - tags[:n]
    longest = int(sizes.max(initial=0))
    if longest > 10:
        return None
    stop = int(last[2 * n - 1]) + 1
    if longest == 1:
        return data[1:stop:2].tobytes(), pos + stop
    keep = np.ones(stop, bool)
    keep[tags[:n]] = False
    return data[:stop][keep].tobytes(), pos + stop


def decode_score_request(buf: bytes, schema: Schema, limits: Limits) -> tuple[Arrays, str]:
    """ScoreRequest bytes -> (the model's arrays in schema order, model_version as sent);
    raises :class:`InvalidRequest` naming what is wrong (bytes that are no ScoreRequest too)."""
    if len(buf) > limits.max_request_bytes:
        raise InvalidRequest(
            f"request is {len(buf)} bytes; the limit is {limits.max_request_bytes}"
        )
    features = len(schema.sparse)
    if _fastwire is not None:
        got = _native(buf, features, len(schema.dense), limits.max_ids_per_feature)
        cols, version, clean = got if got is not None else (None, "", False)
        # as clients send them (schema order) and every value clean: validate_columns' arrays,
        # without its reductions
        if clean and cols is not None and cols.names == list(schema.sparse):
            b = cols.examples
            if 1 <= b <= limits.max_examples:
                lengths = cols.lengths.astype(np.int32).reshape(features, b)
                return (cols.dense.reshape(b, len(schema.dense)), cols.ids, lengths), version
    else:
        parsed = parse(buf, features)
        cols = None if parsed is None else _columns(parsed)
        version = "" if parsed is None else parsed[3]
    if cols is None:  # not the canonical encoding: protobuf decides
        # num_examples, model_version, every feature, and every dense value in its own field
        _bound_fields(buf, features, 2 + features + limits.max_examples * len(schema.dense))
        try:
            request = ranker_pb2.ScoreRequest.FromString(buf)
        except DecodeError as e:
            raise InvalidRequest(
                f"the request is not a valid recsys.v1.ScoreRequest: {e}"
            ) from None
        return validate_columns(columns(request), schema, limits), request.model_version
    return validate_columns(cols, schema, limits), version


def columns_of(
    buf: bytes, max_features: int | None = None, native: bool = True
) -> tuple[Columns, str] | None:
    """A canonically encoded ScoreRequest -> (its :class:`Columns`, model_version); None when
    the bytes are anything else. Raises :class:`InvalidRequest` at the first ``sparse`` entry
    beyond ``max_features``. ``native``: the C twin when it is built (else numpy)."""
    if not native or _fastwire is None:
        parsed = parse(buf, max_features)
        if parsed is None or (cols := _columns(parsed)) is None:
            return None
        return cols, parsed[3]
    got = _native(buf, max_features)
    return None if got is None else got[:2]


def _native(
    buf: bytes, max_features: int | None, dense_width: int = -1, max_ids: int = -1
) -> tuple[Columns, str, bool] | None:
    """:func:`columns_of` by ``_fastwire``, and whether every value passed the checks that
    need no names (given ``dense_width`` and ``max_ids``; see _fastwire.c)."""
    assert _fastwire is not None
    got = _fastwire.columns(buf, -1 if max_features is None else max_features, dense_width, max_ids)
    if got is None:
        return None
    if isinstance(got, int):
        check_feature_count(got, max_features)
        raise AssertionError(f"_fastwire stopped at {got} features under the bound")
    b, at, size, version, names, ids, per, lengths, entries, clean = got
    cols = Columns(
        examples=b,
        dense=np.frombuffer(buf, "<f4", size // 4, at),
        names=names,
        ids=np.frombuffer(ids, np.int64),
        ids_per_feature=np.frombuffer(per, np.int64),
        lengths=np.frombuffer(lengths, np.int64),
        entries=np.frombuffer(entries, np.int64),
    )
    return cols, version, clean


def peek_examples(buf: bytes) -> int:
    """num_examples when it is the first field (as protobuf writers put it), else 0: enough
    to refuse an overload before decoding the request."""
    try:
        return read_varint(buf, 1)[0] if buf[:1] == b"\x08" else 0
    except (IndexError, ValueError):
        return 0


def columns_from_bytes(buf: bytes) -> Columns | None:
    """A canonically encoded ScoreRequest as :class:`Columns`; None when the bytes are
    anything else (the caller parses them with protobuf instead)."""
    got = columns_of(buf)
    return None if got is None else got[0]


def _columns(parsed: Parsed) -> Columns | None:
    b, dense, features, _ = parsed
    ids = decode_fields([x[1] for x in features])
    lengths = decode_fields([x[2] for x in features])  # one byte each, as a rule: no decoding
    if ids is None or lengths is None:
        return None
    return Columns(
        examples=b,
        dense=dense,
        names=[x[0] for x in features],
        ids=ids[0],
        ids_per_feature=ids[1],
        lengths=lengths[0],
        entries=lengths[1],
    )


def score_response(
    scores: np.ndarray, model_name: str, model_version: str, request_id: str = ""
) -> bytes:
    """A ``ScoreResponse``'s bytes, exactly as protobuf serializes it (fields in order, the
    scores packed, empty fields left out), without its message object or a Python float per
    score."""
    data = np.ascontiguousarray(scores, dtype="<f4").tobytes()
    names = _response_names(model_name, model_version)
    rid = request_id.encode("utf-8")
    tail = field_head(0x22, len(rid)) + rid if rid else b""
    return b"".join((field_head(0x0A, len(data)), data, names, tail)) if data else names + tail


@functools.lru_cache(maxsize=64)
def _response_names(model_name: str, model_version: str) -> bytes:
    """A ``ScoreResponse``'s model_name (2) and model_version (3) fields, as they follow its
    scores (1)."""
    out = b""
    for tag, text in ((0x12, model_name), (0x1A, model_version)):
        if data := text.encode("utf-8"):
            out += field_head(tag, len(data)) + data
    return out


def prediction_of(reply: bytes) -> bytes:
    """The ``prediction`` of a serialized ``PredictionResponse``: sliced from the bytes when it
    is their only field (TorchServe's answers), else read by protobuf."""
    if reply[:1] == b"\x0a":
        try:
            n, pos = read_varint(reply, 1)
        except (IndexError, ValueError):  # a cut or overlong length: protobuf names it
            pass
        else:
            if pos + n == len(reply):
                return reply[pos:]
    return bytes(inference_pb2.PredictionResponse.FromString(reply).prediction)
