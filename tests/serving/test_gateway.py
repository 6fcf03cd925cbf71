"""The real gateway in front of a real TorchServe, on free ports, with the tiny exported model
(the shared ``stack`` fixture, tests/stack.py)."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from serving.stubs import ranker_pb2, ranker_pb2_grpc
from serving.tools.client import build_request, gateway_status
from serving.torchserve import process
from serving.torchserve.keys import inference_key
from tests.stack import (
    Stack,
    start_gateway,
    start_torchserve,
    stop_gateway,
    torchserve_config,
    wait_status,
)

pytestmark = pytest.mark.slow
# a busy machine (load 20-35 beside make demo) stretches every call: the bounds tell a hang
# (the client's HANG_S) from a slow answer (the gateway's deadline + SLACK_S), not fast from slow
HANG_S, SLACK_S = 60.0, 10.0


def _request(st: Stack, lo: int, hi: int) -> ranker_pb2.ScoreRequest:
    return build_request(st.rows["dense"][lo:hi], st.rows["sparse"][lo:hi])


@pytest.mark.parametrize(("lo", "hi"), [(0, 1), (0, 500), (500, 1000)])
def test_scores_equal_in_process_torchscript(stack: Stack, lo: int, hi: int) -> None:
    reply = stack.stub.Score(_request(stack, lo, hi), timeout=10)
    assert reply.model_name == "dlrm-tiny" and reply.model_version == "1.0"
    np.testing.assert_allclose(np.asarray(reply.scores), stack.rows["probs_int8"][lo:hi], atol=1e-6)


def test_torchserve_rest_with_json_bodies_scores_the_same(stack: Stack) -> None:
    # JSON over REST (how TorchServe users call it directly) goes through the same handler.
    import http.client
    import json

    names = [f"C{i}" for i in range(1, 27)]
    dense, sparse = stack.rows["dense"][:20], stack.rows["sparse"][:20]
    body = {
        "instances": [
            {
                "dense": dense[i].tolist(),
                "sparse": {names[f]: [int(sparse[i, f])] for f in range(26) if sparse[i, f] >= 0},
            }
            for i in range(20)
        ]
    }
    conn = http.client.HTTPConnection("127.0.0.1", stack.cfg.inference_port, timeout=30)
    headers = {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {inference_key(stack.cfg.key_file)}",
    }
    conn.request("POST", "/predictions/dlrm-tiny/1.0", body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    assert resp.status == 200
    np.testing.assert_allclose(json.loads(resp.read()), stack.rows["probs_int8"][:20], atol=1e-6)
    conn.request(
        "POST",
        "/predictions/dlrm-tiny/1.0",
        body=json.dumps({"instances": [{"dense": [1]}]}),
        headers=headers,
    )
    resp = conn.getresponse()
    assert resp.status == 400 and b"dense has 1 values" in resp.read()


def test_reflection_lists_the_services(stack: Stack) -> None:
    # What grpcurl does: ask the server for its services and the Score method's descriptor.
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(stack.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"recsys.v1.Ranker", "grpc.health.v1.Health"} <= services
        method = db.FindFileContainingSymbol("recsys.v1.Ranker")
        assert "ScoreRequest" in str(method)


def test_backend_calls_in_flight_follow_the_replicas_workers(stack: Stack) -> None:
    """The handler counts its replica's workers in its describe answer; the gateway keeps
    ``coalesce.calls_per_worker`` (1) calls in flight per worker, and as many merged ones waiting."""
    workers = [
        p
        for p in process.group_members(stack.torchserve.pid)
        if "model_service_worker" in " ".join(p.cmdline())
    ]
    want = (
        f"backend calls in flight: at most {len(workers)} per version, +{len(workers)} merged"
        f" waiting (workers {{'{stack.cfg.grpc_inference_target}': {len(workers)}}})"
    )
    log = stack.cfg.workdir / "gateway.log"
    deadline = time.monotonic() + 10  # said after the health round that described it
    while want not in (text := log.read_text(errors="replace")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert want in text, text[-2000:]


def test_100_concurrent_requests_succeed(stack: Stack) -> None:
    def one(i: int) -> bool:
        lo = (i * 37) % 900
        hi = lo + 1 + (i % 50)
        got = np.asarray(stack.stub.Score(_request(stack, lo, hi), timeout=30).scores)
        return bool(np.allclose(got, stack.rows["probs_int8"][lo:hi], atol=1e-6))

    with ThreadPoolExecutor(max_workers=16) as pool:
        assert all(pool.map(one, range(100)))


def _bad_requests(st: Stack) -> list[tuple[str, ranker_pb2.ScoreRequest, str]]:
    good = _request(st, 0, 3)
    cases = []

    def variant(name: str, message: str, mutate) -> None:  # type: ignore[no-untyped-def]
        r = ranker_pb2.ScoreRequest()
        r.CopyFrom(good)
        mutate(r)
        cases.append((name, r, message))

    variant(
        "unknown feature",
        "unknown feature 'C99'",
        lambda r: r.sparse.add(name="C99", ids=[1], lengths=[1, 0, 0]),
    )
    variant("dense count", "dense: 38 values", lambda r: r.dense.pop())
    variant(
        "nan", "dense[I5] of example 1 is nan", lambda r: r.dense.__setitem__(13 + 4, float("nan"))
    )
    variant("negative id", "sparse[C2] of example", lambda r: r.sparse[1].ids.__setitem__(0, -5))
    variant(
        "too many examples", "over the limit of 1000", lambda r: setattr(r, "num_examples", 5000)
    )
    variant("empty", "at least one example", lambda r: r.Clear())
    variant(
        "lengths mismatch",
        "sparse[C3]: lengths add up",
        lambda r: r.sparse[2].lengths.__setitem__(0, 7),
    )
    variant("duplicate feature", "appears twice", lambda r: r.sparse.append(r.sparse[0]))
    big = ranker_pb2.ScoreRequest(num_examples=1, dense=[0.0] * 13)
    big.sparse.add(name="C1", ids=list(range(900_000)), lengths=[900_000])
    cases.append(("oversized", big, "the limit is"))
    return cases


def test_bad_requests_are_invalid_argument_naming_the_field(stack: Stack) -> None:
    for name, request, message in _bad_requests(stack):
        with pytest.raises(grpc.RpcError) as e:
            stack.stub.Score(request, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, e.value.details())
        assert message in e.value.details(), (name, e.value.details())
    test_scores_equal_in_process_torchscript(stack, 0, 1)  # both servers still serve


def test_fuzz_never_internal_and_servers_survive(stack: Stack) -> None:
    rng = random.Random(0)
    codes: dict[str, int] = {}
    base = [_request(stack, i, i + rng.randint(1, 20)) for i in range(0, 200, 20)]
    for i in range(1000):
        r = ranker_pb2.ScoreRequest()
        if i % 4 == 0:  # random bytes that may or may not parse as a ScoreRequest
            try:
                r.ParseFromString(rng.randbytes(rng.randint(0, 400)))
            except Exception:
                r.num_examples = rng.randint(0, 2000)
        else:
            r.CopyFrom(rng.choice(base))
            for _ in range(rng.randint(1, 3)):
                _mutate(r, rng)
        try:
            stack.stub.Score(r, timeout=10)
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
        codes[code] = codes.get(code, 0) + 1
    assert set(codes) <= {"OK", "INVALID_ARGUMENT", "NOT_FOUND"}, codes
    assert codes.get("OK", 0) > 50 and codes.get("INVALID_ARGUMENT", 0) > 400, codes
    assert stack.gateway.poll() is None and stack.torchserve.poll() is None
    assert process.ready_workers(stack.cfg) >= 1  # no worker lost
    test_scores_equal_in_process_torchscript(stack, 0, 500)


def _mutate(r: ranker_pb2.ScoreRequest, rng: random.Random) -> None:
    choice = rng.randrange(8)
    if choice == 0:
        r.num_examples = rng.choice([0, r.num_examples + 1, max(r.num_examples - 1, 0), 10**6])
    elif choice == 1 and r.dense:
        r.dense[rng.randrange(len(r.dense))] = rng.choice([float("nan"), float("inf"), -1e30, 3.0])
    elif choice == 2 and r.sparse:
        f = r.sparse[rng.randrange(len(r.sparse))]
        if f.ids:
            f.ids[rng.randrange(len(f.ids))] = rng.choice([-1, 0, 2**62, -(2**63)])
    elif choice == 3 and r.sparse:
        r.sparse[rng.randrange(len(r.sparse))].name = rng.choice(
            ["", "C0", "c1", "C27", "I1", "C1"]
        )
    elif choice == 4 and r.sparse:
        f = r.sparse[rng.randrange(len(r.sparse))]
        if f.lengths:
            f.lengths[rng.randrange(len(f.lengths))] = rng.choice([-1, 0, 2, 100, 2**31 - 1])
    elif choice == 5:
        del r.dense[rng.randrange(len(r.dense) + 1) :]
    elif choice == 6 and r.sparse:
        del r.sparse[rng.randrange(len(r.sparse))]
    else:
        r.model_version = rng.choice(["", "1.0", "9.9", "x" * 100])


def test_outages_are_unavailable_then_recover(stack: Stack) -> None:
    request = _request(stack, 0, 5)
    # 1. Kill the Python worker: TorchServe restarts it; calls meanwhile fail UNAVAILABLE, fast.
    workers = [
        p
        for p in process.group_members(stack.torchserve.pid)
        if "model_service_worker" in " ".join(p.cmdline())
    ]
    assert workers, "no TorchServe worker found"
    killed = {w.pid for w in workers}
    for w in workers:
        w.kill()
    seen = _assert_fails_unavailable_or_recovers(stack, request)
    assert "UNAVAILABLE" in seen, "killing every worker disrupted nothing: were they the workers?"
    wait_status(stack.target, "SERVING", 120)
    ready = {
        w.get("pid")
        for m in process.describe(stack.cfg)
        for w in m.get("workers", [])
        if w.get("status") == "READY"
    }
    assert ready and all(isinstance(p, int) for p in ready), ready
    assert not ready & killed, f"no new READY worker: {ready} (killed {killed})"
    # 2. Kill TorchServe itself: UNAVAILABLE within the deadline, health NOT_SERVING.
    process.stop(stack.torchserve, timeout=10)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        stack.stub.Score(request, timeout=HANG_S)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert time.monotonic() - t0 < stack.deadline_s + SLACK_S  # no hang past the gateway's deadline
    wait_status(stack.target, "NOT_SERVING", 10)
    # 3. Bring TorchServe back (new keys): health returns to SERVING and scores are right again.
    stack.torchserve = start_torchserve(stack.cfg)
    wait_status(stack.target, "SERVING", 60)
    test_scores_equal_in_process_torchscript(stack, 0, 500)


def _assert_fails_unavailable_or_recovers(
    stack: Stack, request: ranker_pb2.ScoreRequest
) -> set[str]:
    """Right after a worker dies, each call either succeeds or fails UNAVAILABLE within the deadline."""
    seen = set()
    for _ in range(20):
        t0 = time.monotonic()
        try:
            stack.stub.Score(request, timeout=HANG_S)
            seen.add("OK")
        except grpc.RpcError as e:
            seen.add(e.code().name)
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
        assert time.monotonic() - t0 < stack.deadline_s + SLACK_S
        time.sleep(0.1)
    assert seen <= {"OK", "UNAVAILABLE"}, seen
    return seen


def test_an_unknown_model_version_is_not_found(stack: Stack) -> None:
    request = _request(stack, 0, 3)
    request.model_version = "9.9"
    with pytest.raises(grpc.RpcError) as e:
        stack.stub.Score(request, timeout=HANG_S)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
    assert "model_version '9.9' is not served here" in (e.value.details() or "")
    request.model_version = "1.0"  # the served version, named explicitly, scores
    reply = stack.stub.Score(request, timeout=HANG_S)
    np.testing.assert_allclose(np.asarray(reply.scores), stack.rows["probs_int8"][:3], atol=1e-6)


def test_a_client_deadline_that_runs_out_is_deadline_exceeded(stack: Stack) -> None:
    # The client's own deadline, shorter than a 1000-example call takes: DEADLINE_EXCEEDED (not
    # UNAVAILABLE, which would say a backend is down), and the servers carry on.
    codes = []
    for timeout in (0.001, 0.003, 0.01):
        try:
            stack.stub.Score(_request(stack, 0, 1000), timeout=timeout)
            codes.append("OK")
        except grpc.RpcError as e:
            codes.append(e.code().name)
    assert set(codes) <= {"OK", "DEADLINE_EXCEEDED"} and "DEADLINE_EXCEEDED" in codes, codes
    test_scores_equal_in_process_torchscript(stack, 0, 500)
    wait_status(stack.target, "SERVING", 60)  # the servers carried on (generous: a busy box)


def test_not_serving_until_a_probe_through_torchserve_succeeds(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    # A gateway in front of a TorchServe that is not answering (yet): reachable, but
    # NOT_SERVING through several probe intervals, and a Score is UNAVAILABLE. The gateway
    # refuses to start without the key file, which TorchServe writes first thing at startup:
    # the test writes one (no TorchServe start needed).
    export, store, _ = exported
    cfg = torchserve_config(store, tmp_path / "ts")
    cfg.workdir.mkdir()
    keys = {kind: {"key": f"{kind}-key"} for kind in ("inference", "management", "API")}
    cfg.key_file.write_text(json.dumps(keys))
    gateway, target = start_gateway(export / "schema.json", [cfg], tmp_path / "gateway.log")
    try:
        wait_status(target, "NOT_SERVING", 60)
        t0 = time.monotonic()
        seen = set()
        while time.monotonic() - t0 < 3:  # the probe runs every second
            seen.add(gateway_status(target))
            time.sleep(0.2)
        assert seen == {"NOT_SERVING"}, seen
        request = build_request(np.zeros((1, 13)), np.full((1, 26), -1))
        with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as e:
            ranker_pb2_grpc.RankerStub(channel).Score(request, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    finally:
        assert stop_gateway(gateway) == 0
