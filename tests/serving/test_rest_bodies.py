"""Hostile bodies against the real gateway (KServe v2 REST, serving/gateway/kserve_json.py) and
TorchServe on free ports: JSON bombs, nesting, header lengths and non-numbers are 400 with one
line, at once; a message over gRPC's limit logs no traceback; the gateway gives memory back
after a burst of max-size requests (serving/gateway/memory.py); it reads TorchServe's
inference key alone (serving/torchserve/keys.py). One TorchServe for the module."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest

from recsys_stack.net import free_ports
from serving.gateway.kserve_json import HEADER_LENGTH
from serving.gateway.validate import Limits
from serving.torchserve.config import TorchServeConfig
from tests.stack import running_torchserve, start_gateway, stop_gateway, wait_status

pytestmark = pytest.mark.slow
INFER = "/v2/models/dlrm-tiny/infer"
MIB = 1 << 20
LIMIT = Limits().max_request_bytes  # the gateway's default: 4 MiB
B, D, F = 1000, 13, 26  # the most examples a request may have; the tiny model's features


@dataclass
class Gateway:
    http: int
    target: str
    log: Path
    pid: int

    def call(self, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
        """(status, body) of one infer call; 0 when the gateway closed the connection before
        answering (a refusal while the body was still being sent)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}{INFER}", data=body,
                                     method="POST", headers=headers or {})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except (urllib.error.URLError, ConnectionError):
            return 0, ""

    def error(self, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
        """(status, the one-line error) of a call that must fail."""
        status, text = self.call(body, headers)
        assert status != 200, text[:200]
        error = json.loads(text)["error"]
        assert "\n" not in error and len(error) < 400, error
        return status, error

    def rss(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)


@contextlib.contextmanager
def serving(export: Path, ts: TorchServeConfig, log: Path, **overrides: Any) -> Iterator[Gateway]:
    """A gateway (HTTP on a free port) in front of ``ts``, SERVING, for the block."""
    http = free_ports(1)[0]
    proc, target = start_gateway(export / "schema.json", [ts], log, http_port=http,
                                 deadline_s=30.0, **overrides)  # fmt: skip
    try:
        wait_status(target, "SERVING", 60)
        yield Gateway(http, target, log, proc.pid)
    finally:
        assert stop_gateway(proc) == 0


@pytest.fixture(scope="module")
def ts(
    exported: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TorchServeConfig]:
    _, store, _ = exported
    with running_torchserve(
        store, tmp_path_factory.mktemp("ts"), workers=1, response_timeout_s=120
    ) as (cfg, _):
        yield cfg


@pytest.fixture(scope="module")
def gw(
    exported: tuple[Path, Path, str], ts: TorchServeConfig, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    with serving(exported[0], ts, tmp_path_factory.mktemp("gw") / "gateway.log") as g:
        yield g


def _tensors(k: int, seed: int = 0) -> list[tuple[str, str, np.ndarray]]:
    """B examples with ``k`` ids in every feature, as (name, datatype, array)."""
    rng = np.random.default_rng(seed)
    return [("dense", "FP32", rng.standard_normal((B, D)).astype(np.float32)),
            ("values", "INT64", rng.integers(0, 10**6, F * B * k)),
            ("lengths", "INT32", np.full((F, B), k, np.int32))]  # fmt: skip


def json_body(k: int, b: int = B) -> bytes:
    """A valid JSON request of ``b`` examples, ``k`` ids per feature (nested as the shapes)."""
    inputs = [{"name": n, "datatype": d, "shape": list(a.shape), "data": a.tolist()}
              for n, d, a in _tensors(k)]  # fmt: skip
    if b < B:
        inputs[0].update(shape=[b, D], data=inputs[0]["data"][:b])
        inputs[1].update(shape=[F * b * k], data=inputs[1]["data"][: F * b * k])
        inputs[2].update(shape=[F, b], data=[row[:b] for row in inputs[2]["data"]])
    return json.dumps({"inputs": inputs}).encode()


def binary_body(k: int) -> tuple[bytes, dict[str, str]]:
    """A valid request in the binary tensor extension, and its header."""
    tensors = _tensors(k, seed=1)
    raws = [a.tobytes() for _, _, a in tensors]  # little-endian: x86 and arm64 alike
    inputs = [{"name": n, "datatype": d, "shape": list(a.shape),
               "parameters": {"binary_data_size": len(r)}}
              for (n, d, a), r in zip(tensors, raws, strict=True)]  # fmt: skip
    head = json.dumps({"inputs": inputs}).encode()
    return head + b"".join(raws), {HEADER_LENGTH: str(len(head))}


def test_json_bombs_are_400_at_once_and_others_are_served_meanwhile(gw: Gateway) -> None:
    """4 MiB of ``[{},{},...]`` (json.loads: ~0.1 s holding the GIL, ~100 MB; 8 clients of it
    took another client's p99 from 120 ms to 1 s) and of ``[[],[],...]`` (0.45 s): refused at
    the bound, while a valid client is served."""
    n = (LIMIT - 8) // 3
    bombs = {"objects": b"[" + b"{}," * n + b"{}]", "lists": b"[" + b"[]," * n + b"[]]"}
    assert all(len(b) <= LIMIT for b in bombs.values())
    answers: list[tuple[str, int, str, float]] = []

    def attacker(kind: str) -> None:
        for _ in range(3):
            t0 = time.monotonic()
            status, text = gw.call(bombs[kind])
            answers.append((kind, status, text, time.monotonic() - t0))

    threads = [threading.Thread(target=attacker, args=(k,)) for k in [*bombs] * 3]
    for t in threads:
        t.start()
    valid = json_body(1, b=4)
    served = [gw.call(valid)[0] for _ in range(10)]
    for t in threads:
        t.join()
    assert served == [200] * 10
    assert len(answers) == 18
    parsed = set()
    for kind, status, text, seconds in answers:
        error = json.loads(text)["error"]
        # refused while parsing (400), or before, its JSON past the decode queue (429)
        want = {400: "JSON objects" if kind == "objects" else "'[': at most",
                429: "bytes of JSON waiting to be parsed"}.get(status, "?")  # fmt: skip
        assert (want in error, "\n" in error) == (True, False), (kind, status, text)
        assert seconds < 20, f"{kind} answered in {seconds:.1f} s"
        if status == 400:
            parsed.add(kind)
    assert parsed == set(bombs), answers  # each kind was parsed, and refused while parsing


def test_nesting_and_header_lengths_are_400_with_one_line(gw: Gateway) -> None:
    """Each was a 500 with a traceback in the log (RecursionError; int() of 5,000 digits
    past Python's limit; int('²'))."""
    assert gw.error(b"[" * 100_000)[0] == 400
    status, error = gw.error(b'{"a":' * 100_000)
    assert status == 400 and "nests too deep" in error
    body, headers = binary_body(1)
    for length in ("9" * 5000, "\xb2", "-5", "12abc"):
        status, error = gw.error(body, {HEADER_LENGTH: length})
        assert status == 400 and error.startswith(f"{HEADER_LENGTH}: "), error
    assert gw.call(body, headers)[0] == 200
    assert "Traceback" not in gw.log.read_text()


def test_non_numbers_in_data_are_400_naming_the_input(gw: Gateway) -> None:
    good = json.loads(json_body(1, b=2))

    def with_data(name: str, data: Any, shape: list[int] | None = None) -> bytes:
        doc = json.loads(json.dumps(good))
        for t in doc["inputs"]:
            if t["name"] == name:
                t["data"] = data
                t["shape"] = shape or t["shape"]
        return json.dumps(doc).encode()

    n = len(good["inputs"][1]["data"])
    cases = [
        (with_data("values", ["x"] * n), "input 'values': data holds str"),
        (with_data("values", [None] * n), "input 'values': data holds null"),
        (with_data("values", [1] * (n - 2) + [{}, {}]), "input 'values': data holds objects"),
        (with_data("dense", [good["inputs"][0]["data"]]), "input 'dense': data holds lists"),
        (with_data("lengths", [[2**40] * 2] * F), "input 'lengths': data out of the range"),
    ]
    for body, message in cases:
        status, error = gw.error(body)
        assert status == 400 and message in error, (message, error)
    nan = json.dumps(good).replace("[", "[NaN, ", 1).encode()  # refused while parsing
    assert gw.error(nan) == (400, "the request holds NaN: JSON numbers only (finite)")


def test_a_message_over_the_grpc_limit_logs_no_traceback(gw: Gateway) -> None:
    """grpc.aio logged a 1.5 KB ExecuteBatchError traceback for each (the admission gate
    answers a call core had already ended with RESOURCE_EXHAUSTED)."""
    offset = gw.log.stat().st_size
    options = [("grpc.max_send_message_length", 64 * MIB)]
    with grpc.insecure_channel(gw.target, options=options) as channel:
        for method in ("/recsys.v1.Ranker/Score", "/inference.GRPCInferenceService/ModelInfer"):
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary(method)(b"\0" * (2 * LIMIT + MIB), timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    time.sleep(1.0)  # the gateway logs after the client has its status
    with gw.log.open("rb") as f:
        f.seek(offset)
        logged = f.read().decode()
    assert "Traceback" not in logged and "ExecuteBatchError" not in logged, logged[-2000:]


def test_the_gateway_reads_the_inference_key_alone(
    exported: tuple[Path, Path, str], ts: TorchServeConfig, tmp_path: Path
) -> None:
    """A key file whose other entries are not even keys: the gateway serves (it read them
    all, and refused the file)."""
    keys = json.loads(ts.key_file.read_text())
    copy = tmp_path / "keys.json"
    copy.write_text(json.dumps({"inference": keys["inference"], "management": "never read",
                                "API": 7}))  # fmt: skip
    with serving(exported[0], ts, tmp_path / "gateway.log", key_file=str(copy)) as g:
        assert g.call(json_body(1, b=3))[0] == 200


def test_the_gateway_gives_memory_back_after_a_burst(
    exported: tuple[Path, Path, str], ts: TorchServeConfig, tmp_path: Path
) -> None:
    """A burst of max-size requests (JSON and binary, 6 clients) took a gateway's RSS to 2-4x
    its start, for ever; a few seconds after the last one it is back under 1.5x."""
    big = [(json_body(18), {}), binary_body(18)]
    assert all(len(b) <= LIMIT for b, _ in big)
    with serving(exported[0], ts, tmp_path / "gateway.log", health_interval_s=0.5) as g:
        for body, headers in [(json_body(1), {}), binary_body(1)] * 3:
            assert g.call(body, headers)[0] == 200
        time.sleep(1.0)
        start, peak, done = g.rss(), [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], g.rss())
                time.sleep(0.05)

        codes: list[int] = []

        def client(i: int) -> None:
            for j in range(4):
                body, headers = big[(i + j) % 2]
                codes.append(g.call(body, headers)[0])

        sampler = threading.Thread(target=sample)
        sampler.start()
        clients = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        done.set()
        sampler.join()
        after, t0 = g.rss(), time.monotonic()
        while (now := g.rss()) > 1.5 * start and time.monotonic() - t0 < 60:
            time.sleep(0.5)
        mb = [f"{x / MIB:.0f}" for x in (start, peak[0], after, now)]
        print(f"gateway RSS MiB: start {mb[0]}, burst peak {mb[1]}, after {mb[2]}, "
              f"{time.monotonic() - t0:.1f} s later {mb[3]}; codes {sorted(codes)}")  # fmt: skip
        assert codes.count(200) >= 6 and set(codes) <= {200, 429, 0}, codes
        assert peak[0] > 1.5 * start, f"the burst did not grow the heap: {mb}"
        assert now <= 1.5 * start, f"RSS start {mb[0]} MiB, {mb[3]} MiB 60 s after the burst"
