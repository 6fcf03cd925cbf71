"""serving.gateway.wire (the raw-bytes ScoreRequest decoder) against protobuf's own parser.

The fast path must never disagree with protobuf: on canonical requests it must produce the same
columns; on anything else (random bytes, mutations, unpacked fields) the gateway's decoder must
give the same arrays or the same refusal as protobuf + validation would.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from serving.gateway.validate import InvalidRequest, Limits, Schema, columns, validate
from serving.gateway.wire import (
    _varint,
    columns_from_bytes,
    decode_score_request,
    peek_examples,
    varints,
)
from serving.stubs import ranker_pb2

SCHEMA = Schema(
    "m", "1", tuple(f"I{i}" for i in range(1, 14)), tuple(f"C{i}" for i in range(1, 27))
)
LIMITS = Limits(max_examples=1000, max_ids_per_feature=64)


def random_request(rng: np.random.Generator) -> ranker_pb2.ScoreRequest:
    """Valid and invalid alike: any example count, features in any order, ids of every size
    (negative ones are 10-byte varints), lengths that may not add up."""
    b = int(rng.integers(0, 40))
    off_by = int(rng.integers(-1, 2)) if rng.random() < 0.1 else 0
    req = ranker_pb2.ScoreRequest(num_examples=max(0, b + off_by))
    req.dense.extend(rng.normal(size=b * 13 + int(rng.random() < 0.05)).astype(np.float32))
    names = rng.permutation(SCHEMA.sparse)[: int(rng.integers(0, 27))]
    for name in names:
        f = req.sparse.add()
        f.name = str(name)
        lengths = rng.integers(0, 4, size=b)
        if b and rng.random() < 0.05:
            lengths[0] = -1
        f.lengths.extend(lengths.tolist())
        n = int(lengths[lengths > 0].sum()) + int(rng.random() < 0.05)
        big = rng.integers(0, 1 << 62, size=n) >> rng.integers(0, 62, size=n)
        f.ids.extend((big * np.where(rng.random(n) < 0.02, -1, 1)).tolist())
    if rng.random() < 0.3:
        req.model_version = "1" if rng.random() < 0.5 else "ü-" * int(rng.integers(1, 5))
    return req


def test_varints_match_python() -> None:
    rng = np.random.default_rng(0)
    values = [0, 1, 127, 128, 300, (1 << 63) - 1, -1, -(1 << 40)]
    values += rng.integers(-(1 << 62), 1 << 62, size=200).tolist()
    msg = ranker_pb2.SparseFeature(ids=values)
    data = msg.SerializeToString()
    size, start = _varint(data, 1)  # after the tag: the field's length, then its varints
    packed = data[start : start + size]
    got = varints(np.frombuffer(packed, np.uint8))
    assert got is not None
    assert got[0].view(np.int64).tolist() == values


def test_canonical_requests_decode_like_protobuf() -> None:
    rng = np.random.default_rng(1)
    for _ in range(400):
        req = random_request(rng)
        data = req.SerializeToString()
        fast = columns_from_bytes(data)
        ref = columns(ranker_pb2.ScoreRequest.FromString(data))
        assert fast is not None, "a canonical request must take the fast path"
        assert fast.examples == ref.examples and fast.names == ref.names
        for key in ("dense", "ids", "ids_per_feature", "lengths", "entries"):
            assert np.array_equal(getattr(fast, key), getattr(ref, key)), key
        assert peek_examples(data) == (req.num_examples if req.num_examples else 0)


def _reference(data: bytes) -> tuple[list[np.ndarray], str] | str:
    """What protobuf + validation say about ``data``: arrays and version, or 'invalid'."""
    try:
        req = ranker_pb2.ScoreRequest.FromString(data)
        if len(data) > LIMITS.max_request_bytes:
            raise InvalidRequest("too large")
        return list(validate(req, SCHEMA, LIMITS)), req.model_version
    except Exception:  # DecodeError or InvalidRequest: refused either way
        return "invalid"


def _ours(data: bytes) -> tuple[list[np.ndarray], str] | str:
    try:
        arrays, version = decode_score_request(data, SCHEMA, LIMITS)
        return list(arrays), version
    except InvalidRequest:
        return "invalid"


@pytest.mark.parametrize("seed", range(3))
def test_any_bytes_are_decoded_or_refused_like_protobuf(seed: int) -> None:
    """Mutated, truncated, unpacked and random bytes: same arrays or the same refusal."""
    rng = np.random.default_rng(100 + seed)
    for i in range(600):
        req = random_request(rng)
        data = bytearray(req.SerializeToString())
        kind = i % 4
        if kind == 0 and data:  # flip bytes
            for _ in range(int(rng.integers(1, 4))):
                data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        elif kind == 1 and data:  # truncate
            data = data[: int(rng.integers(0, len(data)))]
        elif kind == 2:  # random bytes
            data = bytearray(rng.integers(0, 256, size=int(rng.integers(0, 300)), dtype=np.uint8))
        # kind 3: as serialized (valid or invalid content)
        ref, ours = _reference(bytes(data)), _ours(bytes(data))
        if isinstance(ref, str) or isinstance(ours, str):
            assert ref == ours, (bytes(data)[:60], ref, ours)
        else:
            assert ref[1] == ours[1]
            for a, b in zip(ref[0], ours[0], strict=True):
                assert a.dtype == b.dtype and np.array_equal(a, b)


def test_unpacked_fields_take_protobuf_path() -> None:
    """ids written unpacked (legal protobuf) are not the fast path's, and still decode."""
    b = 2
    dense = np.ones(b * 13, np.float32).tobytes()
    body = bytes([0x08, b, 0x12, len(dense)]) + dense
    feature = bytes([0x0A, 2]) + b"C1" + bytes([0x10, 5, 0x10, 6]) + bytes([0x1A, 2, 1, 1])
    body += bytes([0x1A, len(feature)]) + feature
    assert columns_from_bytes(body) is None
    (d, values, lengths), _ = decode_score_request(body, SCHEMA, LIMITS)
    assert values.tolist() == [5, 6] and lengths[0].tolist() == [1, 1] and d.shape == (2, 13)


def _cpu_ms(data: bytes) -> float:
    """Best of three: this thread's CPU time to decode or refuse ``data`` (ms)."""
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        with contextlib.suppress(InvalidRequest):
            decode_score_request(data, SCHEMA, LIMITS)
        best = min(best, time.thread_time() - start)
    return best * 1e3


def _valid_request_of(size: int) -> bytes:
    """A valid request (1,000 examples) whose ids fill about ``size`` bytes."""
    rng = np.random.default_rng(0)
    b = LIMITS.max_examples
    per = max(1, min(LIMITS.max_ids_per_feature, size // (b * 26 * 9)))
    req = ranker_pb2.ScoreRequest(num_examples=b)
    req.dense.extend(np.ones(b * 13, np.float32))
    for name in SCHEMA.sparse:
        f = req.sparse.add(name=name)
        f.lengths.extend([per] * b)
        f.ids.extend(rng.integers(1 << 56, 1 << 62, size=b * per).tolist())
    return req.SerializeToString()


# Issue 24: 2M empty SparseFeature entries cost 4.6 s of CPU in the parser's Python loop. The
# same trick in every encoding the fast path hands to protobuf: a repeated field, unknown
# fields, dense values each in a field of their own.
CRAFTED = {
    "empty features": b"\x08\x01" + b"\x1a\x00" * 2_000_000,
    "non-canonical prefix": b"\x08\x01\x08\x01" + b"\x1a\x00" * 2_000_000,
    "unknown fields": b"\x08\x01" + b"\x28\x01" * 2_000_000,
    "unpacked dense": b"\x08\x01" + b"\x15\x00\x00\x80\x3f" * 800_000,
}


@pytest.mark.parametrize("kind", CRAFTED)
def test_crafted_4mb_requests_are_refused_in_20ms_of_cpu(kind: str) -> None:
    data = CRAFTED[kind]
    assert 3_900_000 < len(data) <= LIMITS.max_request_bytes
    with pytest.raises(InvalidRequest):
        decode_score_request(data, SCHEMA, LIMITS)
    valid = _valid_request_of(len(data))
    decode_score_request(valid, SCHEMA, LIMITS)  # valid indeed
    crafted, legit = _cpu_ms(data), _cpu_ms(valid)
    print(f"{kind}: {crafted:.2f} ms of CPU; a valid {len(valid)}-byte request {legit:.2f} ms")
    assert crafted <= 20.0
    assert crafted <= 3 * legit + 1.0  # bounded by a small multiple of a valid request's cost


@pytest.mark.parametrize("extra", [1, 2, 100])
def test_more_features_than_the_schema_is_refused_on_both_paths(extra: int) -> None:
    req = ranker_pb2.ScoreRequest(num_examples=1, dense=[0.0] * 13)
    for name in [*SCHEMA.sparse, *["C99"] * extra]:
        req.sparse.add(name=name, lengths=[0])
    canonical = req.SerializeToString()
    # one too many is named (unknown or repeated); more are refused by their count
    expect = "unknown feature 'C99'" if extra == 1 else "more than 27 entries"
    for data in (canonical, b"\x08\x00" + canonical):  # the second is not canonical
        with pytest.raises(InvalidRequest, match=expect):
            decode_score_request(data, SCHEMA, LIMITS)
