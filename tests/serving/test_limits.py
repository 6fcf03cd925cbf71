"""Limits that hold, against the real stack (TorchServe + gateway on free ports).

Everything validation accepts is served (the largest request the limits allow), bytes that are
not a request are INVALID_ARGUMENT, echoed strings are clipped, fuzzed requests never get
INTERNAL/UNKNOWN, the health probe checks the answer, and a key file of the wrong shape leaves
the poller alive. Overload control has its own module (test_overload.py).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from serving.gateway.validate import Limits
from serving.stubs import ranker_pb2, ranker_pb2_grpc
from serving.tools.client import build_request, gateway_status
from tests.stack import Stack, start_gateway, stop_gateway, wait_status

SCORE = "/recsys.v1.Ranker/Score"
LIMITS = Limits()


def raw_score(channel: grpc.Channel, data: bytes, timeout: float = 30) -> bytes:
    """Score with the request given as bytes (the way a broken client would send them)."""
    call = channel.unary_unary(SCORE, request_serializer=None, response_deserializer=None)
    return bytes(call(data, timeout=timeout))


def largest_request(rng: np.random.Generator) -> ranker_pb2.ScoreRequest:
    """max_examples x max_ids_per_feature ids in every one of the 26 features (small ids, so
    the request is within max_request_bytes; as int64 in TorchServe's body it is ~13 MB)."""
    b, k = LIMITS.max_examples, LIMITS.max_ids_per_feature
    req = ranker_pb2.ScoreRequest(num_examples=b)
    req.dense.extend(rng.random(b * 13, dtype=np.float32))
    for i in range(1, 27):
        f = req.sparse.add(name=f"C{i}")
        f.lengths.extend([k] * b)
        f.ids.extend(rng.integers(0, 100, size=b * k).tolist())
    return req


def test_the_largest_request_the_limits_allow_is_served(
    stack: Stack, exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    # Sizes, not speed: a gateway with a long backend deadline (TorchScript's first calls at a
    # new shape are slow, seconds on a busy 2-core machine) in front of the stack's TorchServe.
    rng = np.random.default_rng(0)
    req = largest_request(rng)
    assert req.ByteSize() <= LIMITS.max_request_bytes
    gateway, target = start_gateway(
        exported[0] / "schema.json", [stack.cfg], tmp_path / "gw.log", deadline_s=120
    )
    try:
        wait_status(target, "SERVING", 60)
        with grpc.insecure_channel(target) as channel:
            stub = ranker_pb2_grpc.RankerStub(channel)
            scores = np.asarray(stub.Score(req, timeout=180).scores)
            assert scores.shape == (LIMITS.max_examples,)
            assert ((scores >= 0) & (scores <= 1)).all()
            # one id more in one example is over the limit: refused by name
            req.sparse[3].lengths[7] += 1
            req.sparse[3].ids.append(1)
            with pytest.raises(grpc.RpcError) as e:
                stub.Score(req, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sparse[C4] of example 7 has 65 ids" in (e.value.details() or "")
    finally:
        assert stop_gateway(gateway) == 0


@pytest.mark.parametrize(
    "data", [b"\xff\xff\xff\xff", b"\x12\x05ab", b"\x1a\x03\x0a\x05C", b"\x08"], ids=repr
)
def test_bytes_that_are_not_a_request_are_invalid_argument(stack: Stack, data: bytes) -> None:
    with grpc.insecure_channel(stack.target) as channel, pytest.raises(grpc.RpcError) as e:
        raw_score(channel, data)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "recsys.v1.ScoreRequest" in (e.value.details() or "")


def test_strings_from_the_request_are_echoed_clipped(stack: Stack) -> None:
    long = "x" * 100_000
    req = build_request(stack.rows["dense"][:2], stack.rows["sparse"][:2])
    req.sparse[0].name = long
    with pytest.raises(grpc.RpcError) as e:
        stack.stub.Score(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown feature 'xxx" in e.value.details() and len(e.value.details()) < 500
    req = build_request(stack.rows["dense"][:2], stack.rows["sparse"][:2])
    req.model_version = "é" * 100_000
    with pytest.raises(grpc.RpcError) as e:
        stack.stub.Score(req, timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and len(e.value.details()) < 500


def fuzzed(rng: np.random.Generator, valid: bytes, n: int) -> list[bytes]:
    """Random bytes, mutations and truncations of a valid request, and structured requests
    with out-of-range, oversized and unicode fields."""
    out: list[bytes] = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            out.append(rng.integers(0, 256, int(rng.integers(0, 512)), dtype=np.uint8).tobytes())
        elif kind == 1:
            data = bytearray(valid)
            for _ in range(int(rng.integers(1, 8))):
                data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
            out.append(bytes(data))
        elif kind == 2:
            cut = int(rng.integers(0, len(valid)))
            out.append(valid[:cut] + rng.integers(0, 256, 4, dtype=np.uint8).tobytes())
        else:
            b = int(rng.choice([0, 1, 2, 7, 999, 1001, 1 << 31]))
            req = ranker_pb2.ScoreRequest(num_examples=b)
            req.dense.extend(rng.choice([0.0, -1e38, np.nan, np.inf, 3.5], size=13 * min(b, 3)))
            for name in rng.choice(["C1", "C2", "C1", "Ç1", "C27", "", "C26"], 3):
                f = req.sparse.add(name=str(name))
                f.lengths.extend(rng.integers(-2, 70, min(b, 3)).tolist())
                f.ids.extend(rng.integers(-(1 << 62), 1 << 62, int(rng.integers(0, 8))).tolist())
            req.model_version = str(rng.choice(["", "1.0", "9", "ü" * 300]))
            out.append(req.SerializeToString())
    return out


def test_fuzzed_requests_never_get_internal_or_unknown(stack: Stack) -> None:
    rng = np.random.default_rng(7)
    valid = build_request(stack.rows["dense"][:3], stack.rows["sparse"][:3]).SerializeToString()
    codes: dict[str, int] = {}
    bad: list[tuple[bytes, str, str]] = []
    with grpc.insecure_channel(stack.target) as channel:
        call = channel.unary_unary(SCORE, request_serializer=None, response_deserializer=None)
        batch = fuzzed(rng, valid, 10_000)
        for lo in range(0, len(batch), 64):  # 64 in flight at a time
            futures = [(d, call.future(d, timeout=30)) for d in batch[lo : lo + 64]]
            for data, f in futures:
                try:
                    f.result()
                    name = "OK"
                except grpc.RpcError as e:
                    name = e.code().name
                    if e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                        bad.append((data[:40], name, e.details() or ""))
                codes[name] = codes.get(name, 0) + 1
    print("fuzz codes:", codes)
    assert not bad, bad[:5]
    assert codes.get("INVALID_ARGUMENT", 0) > 5000  # the fuzz did reach validation
    reply = stack.stub.Score(build_request(stack.rows["dense"][:5], stack.rows["sparse"][:5]))
    np.testing.assert_allclose(reply.scores, stack.rows["probs_int8"][:5], atol=1e-6)
    assert gateway_status(stack.target) == "SERVING"


def wait_log(log: Path, text: str, timeout: float = 60) -> str:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        content = log.read_text() if log.exists() else ""
        if text in content:
            return content
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never logged:\n{content[-2000:]}")


def test_probe_checks_the_answer_not_just_the_status(
    stack: Stack, exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    # A gateway whose schema has 12 dense features in front of a model taking 13: TorchServe
    # answers every call OK, with the handler's refusal as the body. Not healthy.
    schema = json.loads((exported[0] / "schema.json").read_text())
    schema["features"]["dense"] = schema["features"]["dense"][:12]
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    gateway, target = start_gateway(tmp_path / "schema.json", [stack.cfg], tmp_path / "gw.log")
    try:
        wait_log(tmp_path / "gw.log", "the probe's answer does not decode")
        time.sleep(2.5)  # more probes: still refused, still not serving
        assert gateway_status(target) == "NOT_SERVING"
    finally:
        assert stop_gateway(gateway) == 0


def test_a_key_file_of_the_wrong_shape_leaves_health_alive(
    stack: Stack, exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    keys = tmp_path / "key_file.json"
    keys.write_text("[1, 2, 3]")  # valid JSON, wrong shape
    replica = dataclasses.replace(stack.cfg, workdir=tmp_path)  # its key_file: ours
    log = tmp_path / "gw.log"
    gateway, target = start_gateway(exported[0] / "schema.json", [replica], log)
    try:
        wait_log(log, "expected")  # the shape is named, once per change
        time.sleep(2.5)
        assert gateway_status(target) == "NOT_SERVING"
        shutil.copy(stack.cfg.key_file, keys)  # the real keys: the same poller picks them up
        wait_status(target, "SERVING", 30)
    finally:
        assert stop_gateway(gateway) == 0
