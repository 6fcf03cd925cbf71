"""KServe v2 over HTTP/JSON on the gateway (serving/gateway/rest.py), against the real gateway
and TorchServe on free ports: a plain HTTP client (urllib, raw sockets) and Triton's own
``tritonclient.http``, with a token file, metrics and a short read timeout; one stack for the
module."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from recsys_stack.net import free_ports
from serving.gateway import kserve
from serving.gateway.config import AuthConfig, MetricsConfig
from serving.gateway.validate import Limits
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request
from serving.worker.codec import to_rows
from tests.stack import (
    gateway_metrics,
    running_torchserve,
    start_gateway,
    stop_gateway,
    wait_status,
)

pytestmark = pytest.mark.slow
MODEL = "dlrm-tiny"
TOKEN = "rest-token-" + "r" * 24
READ_TIMEOUT_S = 2.0  # limits.read_timeout_s of the module's gateway (default 10 s)
INFER = f"/v2/models/{MODEL}/infer"


@dataclass
class Rest:
    http: int  # the gateway's HTTP port
    target: str  # its gRPC target
    metrics: int
    rows: dict[str, np.ndarray]
    backend: str

    def call(
        self, method: str, path: str, body: bytes | None = None, token: str | None = TOKEN,
        **headers: str,
    ) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
        """(status, headers, body) of one request (errors included)."""
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http}{path}", data=body, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()


@pytest.fixture(scope="module")
def rest(
    exported: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Rest]:
    export, store, _ = exported
    work = tmp_path_factory.mktemp("rest")
    (work / "tokens").write_text(TOKEN + "\n")
    http, metrics_port = free_ports(2)
    with running_torchserve(store, work / "ts", workers=1, response_timeout_s=60) as (cfg, _):
        gateway, target = start_gateway(
            export / "schema.json", [cfg], work / "gateway.log", deadline_s=10.0,
            http_port=http, auth=AuthConfig(token_file=str(work / "tokens")),
            metrics=MetricsConfig(port=metrics_port), limits=Limits(read_timeout_s=READ_TIMEOUT_S),
        )  # fmt: skip
        s = np.load(export / "sample.npz")
        rows = {k: s[k] for k in s.files}
        rows["sparse"] = to_rows(rows["values"], rows["lengths"])
        st = Rest(http, target, metrics_port, rows, cfg.grpc_inference_target)
        try:
            wait_status(target, "SERVING", 120)
            deadline = time.monotonic() + 60  # HTTP readiness follows the health rounds
            while st.call("GET", "/v2/health/ready", token=None)[0] != 200:
                assert time.monotonic() < deadline, "/v2/health/ready never answered 200"
                time.sleep(0.2)
            yield st
        finally:
            assert stop_gateway(gateway) == 0  # graceful shutdown (gRPC and HTTP) exits cleanly


def _json_request(rows: dict[str, np.ndarray], lo: int, hi: int, **params: Any) -> bytes:
    """Rows lo..hi as KServe v2 JSON tensors (``dense`` nested, the others flat)."""
    ids = rows["sparse"][lo:hi].T  # [26, B], -1 = missing
    tensors = [
        ("dense", "FP32", rows["dense"][lo:hi]),
        ("values", "INT64", ids[ids >= 0]),
        ("lengths", "INT32", (ids >= 0).astype(np.int32)),
    ]
    inputs = [
        {"name": n, "datatype": d, "shape": list(a.shape),
         "data": a.tolist() if n == "dense" else a.reshape(-1).tolist()}
        for n, d, a in tensors
    ]  # fmt: skip
    return json.dumps({"id": "q1", "inputs": inputs, "parameters": params}).encode()


def test_health_is_open_the_rest_needs_a_token(rest: Rest) -> None:
    for path, want in (("/v2/health/live", {"live": True}), ("/v2/health/ready", {"ready": True})):
        status, _, body = rest.call("GET", path, token=None)
        assert (status, json.loads(body)) == (200, want), path
    for token, why in ((None, "no bearer token"), ("wrong", "not accepted")):
        status, headers, body = rest.call("GET", "/v2", token=token)
        assert status == 401 and why in json.loads(body)["error"]
        assert headers["WWW-Authenticate"].startswith("Bearer")
        status, _, _ = rest.call("POST", INFER, _json_request(rest.rows, 0, 2), token=token)
        assert status == 401
    status, _, body = rest.call("GET", "/v2")
    assert status == 200 and json.loads(body)["name"] == kserve.SERVER_NAME
    status, _, body = rest.call("GET", f"/v2/models/{MODEL}/versions/1.0")
    meta = json.loads(body)
    assert (status, meta["name"], meta["versions"]) == (200, MODEL, ["1.0"])
    got = [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]]
    assert got == [("dense", "FP32", [-1, 13]), ("values", "INT64", [-1]),
                   ("lengths", "INT32", [26, -1])]  # fmt: skip
    assert rest.call("GET", f"/v2/models/{MODEL}/ready")[0] == 200
    for path in ("/v2/models/nope", f"/v2/models/{MODEL}/versions/9/ready", "/v3/x"):
        status, _, body = rest.call("GET", path)
        assert status == 404 and json.loads(body)["error"], path


def test_json_infer_scores_as_grpc_score(rest: Rest) -> None:
    lo, hi = 100, 350
    with grpc.insecure_channel(rest.target) as channel:
        reply = ranker_pb2_grpc.RankerStub(channel).Score(
            build_request(rest.rows["dense"][lo:hi], rest.rows["sparse"][lo:hi]),
            metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30,
        )  # fmt: skip
    status, headers, body = rest.call("POST", INFER, _json_request(rest.rows, lo, hi))
    assert status == 200, body
    doc = json.loads(body)
    (out,) = doc["outputs"]
    assert (out["name"], out["datatype"], out["shape"]) == ("scores", "FP32", [hi - lo])
    assert (doc["id"], doc["model_name"], doc["model_version"]) == ("q1", MODEL, "1.0")
    np.testing.assert_allclose(out["data"], np.asarray(reply.scores), atol=1e-6, rtol=0)
    np.testing.assert_allclose(out["data"], rest.rows["probs_int8"][lo:hi], atol=1e-6, rtol=0)
    assert doc["parameters"]["backend"] == rest.backend == headers["x-recsys-backend"]


def _inputs(rows: dict[str, np.ndarray], binary: bool = True) -> list[triton.InferInput]:
    out = []
    for name, datatype in (("dense", "FP32"), ("values", "INT64"), ("lengths", "INT32")):
        x = triton.InferInput(name, list(rows[name].shape), datatype)
        x.set_data_from_numpy(rows[name], binary_data=binary)
        out.append(x)
    return out


def test_tritonclient_http_binary_and_json(rest: Rest) -> None:
    client = triton.InferenceServerClient(f"127.0.0.1:{rest.http}", network_timeout=60)

    def auth() -> dict[str, str]:  # a new dict per call: infer() adds its header length to it
        return {"Authorization": f"Bearer {TOKEN}"}

    try:
        assert client.is_server_live() and client.is_server_ready()  # no token: health
        assert client.is_model_ready(MODEL, "1.0", headers=auth())
        assert client.get_server_metadata(headers=auth())["extensions"] == ["binary_tensor_data"]
        assert client.get_model_metadata(MODEL, headers=auth())["platform"] == kserve.PLATFORM
        with pytest.raises(InferenceServerException) as e:
            client.get_model_metadata(MODEL)
        assert e.value.status() == "401"
        want = rest.rows["probs_int8"]
        result = client.infer(MODEL, _inputs(rest.rows), headers=auth())  # binary in, binary out
        scores = result.as_numpy("scores")
        assert scores.dtype == np.float32 and scores.shape == want.shape
        np.testing.assert_allclose(scores, want, atol=1e-6, rtol=0)
        assert result.get_output("scores")["parameters"]["binary_data_size"] == 4 * want.size
        typed = triton.InferRequestedOutput("scores", binary_data=False)
        result = client.infer(MODEL, _inputs(rest.rows, binary=False), outputs=[typed],
                              model_version="1.0", headers=auth())  # fmt: skip
        assert "data" in result.get_output("scores")
        np.testing.assert_allclose(result.as_numpy("scores"), want, atol=1e-6, rtol=0)
        with pytest.raises(InferenceServerException) as e:
            client.infer(MODEL, _inputs(rest.rows), model_version="7", headers=auth())
        assert e.value.status() == "404" and "not served here" in str(e.value.message())
    finally:
        client.close()


def _with(body: bytes, mutate: Any) -> bytes:
    doc = json.loads(body)
    mutate(doc)
    return json.dumps(doc).encode()


def test_bad_input_is_400_naming_it_and_the_gateway_serves_on(rest: Rest) -> None:
    good = _json_request(rest.rows, 0, 4)
    dense = rest.rows["dense"][:4].astype("<f4").tobytes()

    def shape(doc: dict[str, Any]) -> None:
        doc["inputs"][0].update(shape=[4, 12], data=[row[:12] for row in doc["inputs"][0]["data"]])

    def name(doc: dict[str, Any]) -> None:
        doc["inputs"][1]["name"] = "ids"

    def words(doc: dict[str, Any]) -> None:
        doc["inputs"][1]["data"] = ["a"] * len(doc["inputs"][1]["data"])

    def binary(doc: dict[str, Any]) -> None:
        doc["inputs"][0] = {"name": "dense", "datatype": "FP32", "shape": [4, 13],
                            "parameters": {"binary_data_size": len(dense)}}  # fmt: skip

    head = _with(good, binary)
    short = {"Inference-Header-Content-Length": str(len(head))}
    cases = [
        (_with(good, shape), {}, "dense: shape [4, 12], the model takes [B, 13]"),
        (_with(good, name), {}, "input 'ids': unknown"),
        (_with(good, words), {}, "input 'values': data holds str"),
        (b'{"inputs": [', {}, "the request is not JSON"),
        (head + dense[:-4], short, "binary_data_size 208, but 204 bytes of binary data are left"),
        (head + dense, {"Inference-Header-Content-Length": "x"},
         "Inference-Header-Content-Length: 'x'"),
    ]  # fmt: skip
    for body, headers, message in cases:
        status, _, reply = rest.call("POST", INFER, body, **headers)
        error = json.loads(reply)["error"]
        assert status == 400 and message in error and "\n" not in error, (message, reply)
    status, _, reply = rest.call("POST", INFER, head + dense, **short)  # binary done right
    assert status == 200 and len(json.loads(reply)["outputs"][0]["data"]) == 4


def _raw(rest: Rest, head: str, body: bytes = b"", wait_s: float = 30.0) -> bytes:
    """What the gateway answers to ``head`` (and ``body``) sent on a socket, until it closes."""
    with socket.create_connection(("127.0.0.1", rest.http), timeout=wait_s) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def test_an_oversized_body_is_413_unread_and_an_idle_one_408(rest: Rest) -> None:
    auth = f"Authorization: Bearer {TOKEN}\n"
    for expect in ("", "Expect: 100-continue\n"):  # a GB announced, never sent
        got = _raw(rest, f"POST {INFER} HTTP/1.1\nHost: x\n{auth}{expect}"
                   "Content-Length: 1000000000\n")  # fmt: skip
        assert got.startswith(b"HTTP/1.1 413 "), got[:200]  # no "100 Continue" first
        assert b"the limit is 4194304 (limits.max_request_bytes)" in got
    t0 = time.monotonic()  # 10 bytes of an announced 100, then silence: the read is bounded
    got = _raw(rest, f"POST {INFER} HTTP/1.1\nHost: x\n{auth}Content-Length: 100\n", b"{" * 10)
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert b"limits.read_timeout_s" in got and time.monotonic() - t0 < 30
    status, _, _ = rest.call("POST", INFER, _json_request(rest.rows, 0, 2))
    assert status == 200  # nothing held: the door and the budget are free


def test_rest_calls_are_counted_like_grpc_ones(rest: Rest) -> None:
    def counts() -> dict[str, float]:
        got = gateway_metrics(rest.metrics)
        return {
            dict(labels)["code"]: value
            for (name, labels), value in got.items()
            if name == "recsys_gateway_requests_total"
            and dict(labels)["method"] == "POST /v2/models/{name}/infer"
        }

    before = counts()
    assert rest.call("POST", INFER, _json_request(rest.rows, 0, 3))[0] == 200
    assert rest.call("POST", INFER, _json_request(rest.rows, 0, 3), token=None)[0] == 401
    assert rest.call("POST", INFER, b"[]")[0] == 400
    after = counts()
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert delta == {"OK": 1, "UNAUTHENTICATED": 1, "INVALID_ARGUMENT": 1}
    got = gateway_metrics(rest.metrics)
    assert got[("recsys_gateway_request_seconds_count",
                (("method", "GET /v2/health/ready"),))] >= 1  # fmt: skip
