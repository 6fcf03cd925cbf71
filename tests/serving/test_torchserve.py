"""A real TorchServe (Java frontend + Python worker) serving the tiny exported .mar over gRPC.

One instance for the module, on free ports, batching on (8 requests, 5 ms), one worker.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
import torch

from serving import protos
from serving.codec import decode_response, encode_request
from serving.protos import ensure_generated
from serving.torchserve import (
    PORT_ENV,
    RequestRejected,
    TorchServeConfig,
    free_ports,
    group_members,
    inference_key,
    read_keys,
    score_grpc,
    start,
    stop,
    wait_ready,
    write_properties,
)

ensure_generated()
from serving._gen import inference_pb2, inference_pb2_grpc  # noqa: E402

# Java startup + worker load is ~10 s on a laptop; a 2-core CI box under load needs more.
STARTUP_TIMEOUT_S = 240
CALL_TIMEOUT_S = 30


def _ours(workdir: Path) -> list[psutil.Process]:
    """Live processes whose command line names our workdir (java -f <workdir>/config.properties)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(workdir) in " ".join(
                p.info["cmdline"] or []
            ):
                out.append(p)
        except psutil.Error:
            continue
    return out


class Sample:
    """The export's 1000 encoded rows and their expected int8-model probabilities."""

    def __init__(self, export: Path) -> None:
        s = np.load(export / "sample.npz")
        self.dense = torch.from_numpy(s["dense"])
        self.values = torch.from_numpy(s["values"])
        self.lengths = torch.from_numpy(s["lengths"])
        self.expected = s["probs_int8"]
        self._by_feature = torch.split(self.values, self.lengths.sum(dim=1).tolist())

    def body(self, lo: int, hi: int) -> bytes:
        """RSB1 request for rows ``[lo, hi)``."""
        vals = torch.cat(
            [
                f[ln[:lo].sum() : ln[:hi].sum()]
                for f, ln in zip(self._by_feature, self.lengths, strict=True)
            ]
        )
        return encode_request(
            self.dense[lo:hi].contiguous(), vals, self.lengths[:, lo:hi].contiguous()
        )


def test_ports_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_ENV["grpc_inference_port"], "17070")
    cfg = TorchServeConfig()
    assert (cfg.grpc_inference_port, cfg.inference_port) == (17070, 8080)
    monkeypatch.setenv(PORT_ENV["inference_port"], "http")
    with pytest.raises(ValueError, match="RECSYS_TS_INFERENCE_PORT='http' is not a port"):
        TorchServeConfig()


def test_properties_keep_auth_on_and_register_the_model(tmp_path: Path) -> None:
    (tmp_path / "m-2.mar").write_bytes(b"")
    cfg = TorchServeConfig(
        model_store=tmp_path, model_name="m", model_version="2", workdir=tmp_path / "w"
    )
    props = dict(
        line.split("=", 1)
        for line in write_properties(cfg).read_text().splitlines()
        if not line.startswith("#")
    )
    assert props["disable_token_authorization"] == "false"
    assert props["enable_model_api"] == "false"
    assert props["inference_address"] == "http://127.0.0.1:8080"
    assert props["load_models"] == "m-2.mar"
    model = json.loads(props["models"])["m"]["2"]
    assert (model["batchSize"], model["maxBatchDelay"], model["maxWorkers"]) == (8, 5, 1)
    with pytest.raises(FileNotFoundError, match=r"m-3\.mar not found"):
        write_properties(TorchServeConfig(model_store=tmp_path, model_name="m", model_version="3"))


def test_stub_generation_is_idempotent(tmp_path: Path) -> None:
    local = tmp_path / "proto" / "demo" / "v1"
    local.mkdir(parents=True)
    (local / "echo.proto").write_text(
        'syntax = "proto3";\npackage demo.v1;\nmessage Ping { string s = 1; }\n'
        "service Echo { rpc Call(Ping) returns (Ping); }\n"
    )
    out = tmp_path / "gen"

    def gen() -> bool:
        return protos.generate(out, package="gen", local_dir=tmp_path / "proto")

    assert gen() is True
    assert gen() is False  # up to date
    assert (out / "inference_pb2_grpc.py").is_file()
    grpc_module = (out / "demo" / "v1" / "echo_pb2_grpc.py").read_text()
    assert "from gen.demo.v1 import echo_pb2" in grpc_module  # package-qualified imports
    (local / "echo.proto").write_text((local / "echo.proto").read_text() + "// changed\n")
    assert gen() is True


@pytest.fixture(scope="module")
def served(
    exported: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TorchServeConfig, str, Sample]]:
    export, store, _ = exported
    ports = free_ports(5)
    cfg = TorchServeConfig(
        inference_port=ports[0],
        management_port=ports[1],
        metrics_port=ports[2],
        grpc_inference_port=ports[3],
        grpc_management_port=ports[4],
        model_store=store,
        mar_file="dlrm-tiny-1.0.mar",
        model_name="dlrm-tiny",
        model_version="1.0",
        workers=1,
        batch_size=8,
        max_batch_delay_ms=5,
        response_timeout_s=60,
        workdir=tmp_path_factory.mktemp("ts"),
    )
    proc = start(cfg)
    try:
        secs = wait_ready(cfg, timeout=STARTUP_TIMEOUT_S, proc=proc)
        print(f"torchserve ready in {secs:.1f} s")
        yield cfg, inference_key(cfg), Sample(export)
    finally:
        t0 = time.monotonic()
        stop(proc, timeout=30)
        print(f"torchserve stopped in {time.monotonic() - t0:.1f} s")
    assert not group_members(proc.pid)
    assert not _ours(cfg.workdir.resolve()), "a java/worker process outlived stop()"


@pytest.fixture(scope="module")
def channel(served: tuple[TorchServeConfig, str, Sample]) -> Iterator[grpc.Channel]:
    cfg = served[0]
    with grpc.insecure_channel(cfg.grpc_inference_target) as ch:
        grpc.channel_ready_future(ch).result(timeout=CALL_TIMEOUT_S)
        yield ch


@pytest.mark.slow
@pytest.mark.parametrize(("lo", "hi"), [(0, 1), (500, 1000)])
def test_predictions_match_the_export(
    served: tuple[TorchServeConfig, str, Sample], channel: grpc.Channel, lo: int, hi: int
) -> None:
    cfg, key, sample = served
    probs = decode_response(score_grpc(channel, cfg, sample.body(lo, hi), CALL_TIMEOUT_S, key))
    assert probs.shape == (hi - lo,)
    np.testing.assert_allclose(probs.numpy(), sample.expected[lo:hi], atol=1e-6, rtol=0)


def _batches(cfg: TorchServeConfig) -> int:
    """handle() calls so far: the worker logs one line per batch it receives."""
    log = cfg.workdir / "logs" / "model_log.log"
    return log.read_text().count("Backend received inference at")


@pytest.mark.slow
def test_concurrent_requests_are_batched_and_split_back(
    served: tuple[TorchServeConfig, str, Sample], channel: grpc.Channel
) -> None:
    cfg, key, sample = served
    sizes = [1, 2, 3, 5, 8, 13, 21, 34]  # 40 requests cycle through these sizes
    cuts, lo = [], 0
    for i in range(40):
        size = sizes[i % len(sizes)]
        lo = lo if lo + size <= 1000 else 0
        cuts.append((lo, lo + size))
        lo += size
    bodies = [sample.body(a, b) for a, b in cuts]
    before = _batches(cfg)
    # all 40 in flight together: TorchServe aggregates up to 8 per handle() call
    with ThreadPoolExecutor(max_workers=40) as pool:
        replies = list(
            pool.map(lambda body: score_grpc(channel, cfg, body, CALL_TIMEOUT_S, key), bodies)
        )
    for (a, b), reply in zip(cuts, replies, strict=True):
        np.testing.assert_allclose(
            decode_response(reply).numpy(), sample.expected[a:b], atol=1e-6, rtol=0
        )
    batches = _batches(cfg) - before
    print(f"40 concurrent requests -> {batches} batches")
    assert 0 < batches < 40, "TorchServe did not aggregate any requests"


@pytest.mark.slow
def test_malformed_body_fails_alone_and_the_worker_survives(
    served: tuple[TorchServeConfig, str, Sample], channel: grpc.Channel
) -> None:
    cfg, key, sample = served
    truncated = sample.body(0, 4)[:-8]
    # TorchServe 0.12 gRPC drops the 400 the handler sets for this request: the call is OK and
    # the prediction is the handler's message (REST answers 400). score_grpc raises on it.
    stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
    request = inference_pb2.PredictionsRequest(model_name=cfg.model_name, input={"data": truncated})
    reply, call = stub.Predictions.with_call(
        request, timeout=CALL_TIMEOUT_S, metadata=(("authorization", f"Bearer {key}"),)
    )
    assert call.code() == grpc.StatusCode.OK
    reason = f"invalid request: body is {len(truncated)} bytes".encode()
    assert reply.prediction.startswith(reason), reply.prediction
    with pytest.raises(RequestRejected, match=r"its header \(B=4, N=\d+\) needs"):
        score_grpc(channel, cfg, truncated, CALL_TIMEOUT_S, key)
    rest = urllib.request.Request(
        f"http://{cfg.host}:{cfg.inference_port}/predictions/{cfg.model_name}",
        data=truncated,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/octet-stream"},
    )
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(rest, timeout=CALL_TIMEOUT_S)
    assert http_err.value.code == 400
    assert b"needs" in http_err.value.read()
    probs = decode_response(score_grpc(channel, cfg, sample.body(0, 4), CALL_TIMEOUT_S, key))
    np.testing.assert_allclose(probs.numpy(), sample.expected[0:4], atol=1e-6, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("token", ["", "wrong", "management"])
def test_calls_without_the_inference_key_are_rejected(
    served: tuple[TorchServeConfig, str, Sample], channel: grpc.Channel, token: str
) -> None:
    cfg, _, sample = served
    stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
    request = inference_pb2.PredictionsRequest(
        model_name=cfg.model_name, input={"data": sample.body(0, 1)}
    )
    key = read_keys(cfg)["management"] if token == "management" else token
    metadata = (("authorization", f"Bearer {key}"),) if token else None
    with pytest.raises(grpc.RpcError) as err:
        stub.Predictions(request, timeout=CALL_TIMEOUT_S, metadata=metadata)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
    assert "Token Authorization failed" in (err.value.details() or "")
