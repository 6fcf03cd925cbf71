"""The lite backend (serving/lite): the stack's handler behind TorchServe's gRPC inference API
in one process per worker, run for real: ``python -m serving.lite`` with two workers, the
gateway in front of it, the export's own scores back, TorchServe's refusals (key, model,
body), and a worker killed under load restarted by the launcher with no call failed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest

from serving.gateway.config import HedgeConfig
from serving.gateway.localsock import SocketChannel
from serving.gateway.replica import probe_body
from serving.lite.frames import MAX_FRAME, REPLY, REQUEST, SCHEME
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request
from serving.torchserve.client import (
    RequestRejected,
    bearer,
    inference_key,
    inference_stub,
    predictions_request,
    score,
)
from serving.worker.codec import DESCRIBE, HEADER, REJECTION, encode_request, to_rows
from tests.stack import start_gateway, stop_gateway, wait_status

pytestmark = pytest.mark.slow
ROWS = 16


@contextlib.contextmanager
def lite(
    mar: Path, folder: Path, workers: int = 2, transport: str = "socket"
) -> Iterator[tuple[subprocess.Popen[str], dict]]:
    """``python -m serving.lite MAR`` on free ports; (launcher, its JSON line); stopped after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.lite", str(mar), "--workers", str(workers),
         "--port", "0", "--dir", str(folder), "--transport", transport],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("{"), f"launcher said {line!r}, exit {proc.poll()}"
        yield proc, json.loads(line)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def workers_of(launcher: subprocess.Popen[str]) -> list[psutil.Process]:
    return psutil.Process(launcher.pid).children()


def test_the_gateway_in_front_of_lite_workers_scores_like_the_export(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """Over the workers' sockets, as the launcher prints it (their gRPC door is TorchServe's
    API, which the gateway's other tests call; its refusals: the test below)."""
    export, store, _ = exported
    s = np.load(export / "sample.npz")
    request = build_request(s["dense"][:ROWS], to_rows(s["values"], s["lengths"])[:ROWS])
    with lite(store / "dlrm-tiny-1.0.mar", tmp_path / "lite") as (launcher, said):
        backends = said["backend"].split(",")
        assert len(backends) == 2 and all(b.startswith("lite:/") for b in backends), backends
        assert len(said["key_file"].split(",")) == 2  # each worker's own key file
        assert "{port}" in said["grpc"]["key_file"] and len(said["grpc"]["backend"].split(",")) == 2
        assert said["hedge"] == {"ratio": 0.0}
        assert len(workers_of(launcher)) == 2
        gateway, target = start_gateway(
            export / "schema.json", [], tmp_path / "gateway.log",
            backend=said["backend"], key_file=said["key_file"],
            hedge=HedgeConfig(**said["hedge"]),  # as the launcher says: hedging off
        )  # fmt: skip
        try:
            wait_status(target, "SERVING", 60)
            with grpc.insecure_channel(target) as channel:
                stub = ranker_pb2_grpc.RankerStub(channel)
                reply = stub.Score(request, timeout=10)
                np.testing.assert_allclose(reply.scores, s["probs_int8"][:ROWS], atol=1e-6)
                # a worker killed under load: the gateway fails over, the launcher starts
                # it again (a new key file, which the gateway reads), no call fails
                outcomes: list[str] = []
                stop = threading.Event()

                def call() -> None:
                    while not stop.is_set():
                        try:
                            r = stub.Score(request, timeout=10)
                            ok = np.allclose(r.scores, s["probs_int8"][:ROWS], atol=1e-6)
                            outcomes.append("OK" if ok else "BAD_SCORES")
                        except grpc.RpcError as e:
                            outcomes.append(e.code().name)

                threads = [threading.Thread(target=call) for _ in range(3)]
                for t in threads:
                    t.start()
                time.sleep(1)
                victim = workers_of(launcher)[0]
                victim.send_signal(signal.SIGKILL)
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    now = workers_of(launcher)
                    if len(now) == 2 and victim.pid not in {p.pid for p in now}:
                        break
                    time.sleep(0.2)
                else:
                    raise AssertionError("the launcher did not start the killed worker again")
                time.sleep(8)  # the new worker loads and takes calls
                stop.set()
                for t in threads:
                    t.join()
                counts = {k: outcomes.count(k) for k in set(outcomes)}
                assert counts.get("OK", 0) > 20 and set(counts) == {"OK"}, counts
                metrics = reply_backends(stub, request)
                assert len(metrics) == 2, f"calls reach both workers again: {metrics}"
        finally:
            assert stop_gateway(gateway) == 0


def reply_backends(stub: ranker_pb2_grpc.RankerStub, request: object) -> set[str]:
    """The backends that answered 40 calls (the gateway's x-recsys-backend trailer)."""
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while len(seen) < 2 and time.monotonic() < deadline:
        _, call = stub.Score.with_call(request, timeout=10)
        seen.add(dict(call.trailing_metadata()).get("x-recsys-backend", "?"))
    return seen


def test_a_lite_worker_refuses_as_torchserve_does(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """A wrong key, another model or version, a malformed body: TorchServe's answers."""
    export, store, _ = exported
    s = np.load(export / "sample.npz")
    body = encode_request(s["dense"][:2], *_first_two(s))
    with lite(store / "dlrm-tiny-1.0.mar", tmp_path / "lite", 1, "grpc") as (_, said):
        target = said["backend"]
        key_file = Path(said["key_file"].format(port=target.rsplit(":", 1)[1]))
        assert oct(key_file.stat().st_mode & 0o777) == "0o600"
        key = inference_key(key_file)
        with grpc.insecure_channel(target) as channel:
            ok = np.frombuffer(score(channel, ("dlrm-tiny", "1.0"), body, 10, key), np.float32)
            np.testing.assert_allclose(ok, s["probs_int8"][:2], atol=1e-6)
            with pytest.raises(grpc.RpcError) as e:
                score(channel, ("dlrm-tiny", "1.0"), body, 10, "not-the-key")
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            for model in (("other", "1.0"), ("dlrm-tiny", "2.0")):
                with pytest.raises(grpc.RpcError) as e:
                    score(channel, model, body, 10, key)
                assert e.value.code() == grpc.StatusCode.NOT_FOUND, model
                assert "dlrm-tiny 1.0" in (e.value.details() or "")
            with pytest.raises(RequestRejected, match=r"RSB1|magic|short|body"):
                score(channel, ("dlrm-tiny", "1.0"), b"RSB1 but cut", 10, key)
            # the worker lives on after a refusal
            ok = np.frombuffer(score(channel, ("dlrm-tiny", "1.0"), body, 10, key), np.float32)
            assert ok.shape == (2,)
            # its describe answer (what the gateway asks): one worker, so one call in flight
            request = predictions_request("dlrm-tiny", "1.0", b"")
            del request.input["data"]
            request.input[DESCRIBE] = b""
            reply = inference_stub(channel).Predictions(request, timeout=10, metadata=bearer(key))
            described = json.loads(reply.prediction)
            assert described["workers"] == 1 and described["variant"] == "int8", described


def test_a_lite_workers_socket_answers_in_order_and_refuses_as_its_grpc_door_does(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """The gateway's door (``lite:PATH``, serving/gateway/localsock.py against a real worker):
    pipelined calls answered in order, TorchServe's refusals as gRPC errors, a call whose
    deadline passed in the queue answered unscored, an oversized frame ending only its own
    connection, an absent worker UNAVAILABLE at once."""
    export, store, _ = exported
    s = np.load(export / "sample.npz")
    body = encode_request(s["dense"][:2], *_first_two(s))
    with lite(store / "dlrm-tiny-1.0.mar", tmp_path / "lite", workers=1) as (launcher, said):
        path = said["backend"].removeprefix(SCHEME)
        assert oct(Path(path).stat().st_mode & 0o777) == "0o600"
        assert oct(Path(path).parent.stat().st_mode & 0o777) == "0o700"
        key = inference_key(Path(said["key_file"]))
        asyncio.run(_socket_calls(path, key, body, s["probs_int8"][:2]))
        # frames by hand: a deadline already passed, then a frame over the limit
        with socket.socket(socket.AF_UNIX) as raw:
            raw.settimeout(30)
            raw.connect(path)
            hello = bearer(key)[0][1].encode()
            raw.sendall(REQUEST.pack(len(hello), 0) + hello)
            request = predictions_request("dlrm-tiny", "1.0", body).SerializeToString()
            raw.sendall(REQUEST.pack(len(request), time.time() - 1) + request)
            assert _read_reply(raw)[0] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            raw.sendall(REQUEST.pack(MAX_FRAME + 1, 0))
            status, why = _read_reply(raw)
            assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], why
            assert raw.recv(1) == b"", "the connection is closed after it"
        asyncio.run(_socket_calls(path, key, body, s["probs_int8"][:2]))  # others unharmed
        asyncio.run(_paused(path, key, body, workers_of(launcher)[0]))
    gone = SocketChannel(path)  # the worker stopped: refused at once, not after a timeout

    async def after() -> None:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await gone.predictions(b"", bearer(key), 10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    t0 = time.monotonic()
    asyncio.run(after())
    assert time.monotonic() - t0 < 5


async def _socket_calls(path: str, key: str, body: bytes, want: np.ndarray) -> None:
    good = bearer(key)
    channel = SocketChannel(path)

    def request(model: tuple[str, str] = ("dlrm-tiny", "1.0"), b: bytes = body) -> bytes:
        return predictions_request(*model, b).SerializeToString()

    try:
        many = await asyncio.gather(*(channel.predictions(request(), good, 30) for _ in range(20)))
        for out in many:  # pipelined on one connection, each its own answer
            np.testing.assert_allclose(np.frombuffer(out, np.float32), want, atol=1e-6)
        # requests of other sizes in one pipeline: each gets its own number of scores
        dense, sparse = HEADER.unpack_from(body)[2:4]
        one = request(b=probe_body(dense, sparse))
        mixed = await asyncio.gather(
            channel.predictions(one, good, 30), channel.predictions(request(), good, 30)
        )
        assert len(np.frombuffer(mixed[0], np.float32)) == 1
        np.testing.assert_allclose(np.frombuffer(mixed[1], np.float32), want, atol=1e-6)
        for model in (("other", "1.0"), ("dlrm-tiny", "2.0")):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await channel.predictions(request(model), good, 30)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND and "dlrm-tiny 1.0" in (
                e.value.details() or ""
            )
        refused = await channel.predictions(request(b=b"RSB1 but cut"), good, 30)
        assert refused.startswith(REJECTION), refused  # the handler's, as in TorchServe
        stranger = SocketChannel(path)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stranger.predictions(request(), bearer("not-the-key"), 30)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        await stranger.close()
        out = await channel.predictions(request(), good, 30)  # still served
        np.testing.assert_allclose(np.frombuffer(out, np.float32), want, atol=1e-6)
    finally:
        await channel.close()


async def _paused(path: str, key: str, body: bytes, worker: psutil.Process) -> None:
    """A paused worker: calls end at their deadline, not later; once it runs again, the next
    call gets its own answer (the expired calls' answers, or none, do not take its place)."""
    channel = SocketChannel(path)
    request = predictions_request("dlrm-tiny", "1.0", body).SerializeToString()
    dense, sparse = HEADER.unpack_from(body)[2:4]
    one = predictions_request("dlrm-tiny", "1.0", probe_body(dense, sparse)).SerializeToString()
    try:
        await channel.predictions(request, bearer(key), 30)  # connected
        worker.suspend()
        try:
            t0 = time.monotonic()
            late = await asyncio.gather(
                *(channel.predictions(request, bearer(key), 1.0) for _ in range(6)),
                return_exceptions=True,
            )
            waited = time.monotonic() - t0
        finally:
            worker.resume()
        codes = [e.code() if isinstance(e, grpc.aio.AioRpcError) else e for e in late]
        assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 6 and waited < 10, (codes, waited)
        answer = await channel.predictions(one, bearer(key), 30)
        assert len(np.frombuffer(answer, np.float32)) == 1
    finally:
        await channel.close()


def _read_reply(raw: socket.socket) -> tuple[int, bytes]:
    head = b""
    while len(head) < REPLY.size:
        head += raw.recv(REPLY.size - len(head))
    n, status = REPLY.unpack(head)
    payload = b""
    while len(payload) < n:
        payload += raw.recv(n - len(payload))
    return status, payload


def _first_two(s: np.lib.npyio.NpzFile) -> tuple[np.ndarray, np.ndarray]:
    """The sample's first two examples as feature-major values and lengths (RSB1's layout)."""
    rows = to_rows(s["values"], s["lengths"])[:2]  # int64[2, F], -1 = missing
    present = rows.T >= 0
    return rows.T[present], present.astype(np.int32)


def test_the_launcher_refuses_what_is_not_a_mar(tmp_path: Path) -> None:
    bad = tmp_path / "x.mar"
    bad.write_bytes(b"not a zip")
    out = subprocess.run(
        [sys.executable, "-m", "serving.lite", str(bad), "--dir", str(tmp_path / "l")],
        capture_output=True, text=True, timeout=60, env={**os.environ},
    )  # fmt: skip
    assert out.returncode == 1 and "not a .mar" in out.stderr, out.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "serving.lite", str(tmp_path / "none.mar")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2 and "make export" in missing.stderr, missing.stderr
    deep = subprocess.run(  # no worker could listen there: said before anything starts
        [sys.executable, "-m", "serving.lite", str(bad), "--dir", str(tmp_path / ("d" * 110))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert deep.returncode == 1 and "use a shorter folder" in deep.stderr, deep.stderr
