"""A real TorchServe (Java frontend + Python worker) serving the tiny exported .mar over gRPC.

One instance for the module (the shared ``torchserve`` fixture), batching on (8 requests,
100 ms), one worker.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import shutil
import subprocess
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

from recsys_stack.config import ConfigError, load
from serving.torchserve import manage, process
from serving.torchserve.client import (
    RequestRejected,
    inference_stub,
    predictions_request,
    score,
)
from serving.torchserve.config import TorchServeConfig, resolve_model, write_properties
from serving.torchserve.keys import KeyFileError, bearer, inference_key, read_keys
from serving.worker.codec import decode_response, encode_request
from serving.worker.scoring import slice_examples

CALL_TIMEOUT_S = 30
Served = tuple[TorchServeConfig, subprocess.Popen[bytes]]


class Sample:
    """The export's 1000 encoded rows and their expected int8-model probabilities."""

    def __init__(self, export: Path) -> None:
        s = np.load(export / "sample.npz")
        self.dense = torch.from_numpy(s["dense"])
        self.values = torch.from_numpy(s["values"])
        self.lengths = torch.from_numpy(s["lengths"])
        self.expected = s["probs_int8"]

    def body(self, lo: int, hi: int) -> bytes:
        """RSB1 request for rows ``[lo, hi)``."""
        return encode_request(*slice_examples(self.dense, self.values, self.lengths, lo, hi))


def test_ports_come_from_the_environment_at_load_time() -> None:
    env = {"RECSYS_TS_GRPC_INFERENCE_PORT": "17070"}
    cfg = load(TorchServeConfig, environ=env)
    assert (cfg.grpc_inference_port, cfg.inference_port) == (17070, 8080)
    assert TorchServeConfig().grpc_inference_port == 7070  # constructing reads no variable
    with pytest.raises(ConfigError, match=r"RECSYS_TS_INFERENCE_PORT.*'http'.*expected int"):
        load(TorchServeConfig, environ={"RECSYS_TS_INFERENCE_PORT": "http"})
    with pytest.raises(ConfigError, match="not a port number"):
        load(TorchServeConfig, overrides=["metrics_port=70000"], environ={})


def test_the_model_comes_from_the_archive_or_the_newest_one(tmp_path: Path) -> None:
    import zipfile

    for name, version in (("old", "1"), ("new", "2")):
        with zipfile.ZipFile(tmp_path / f"{name}-{version}.mar", "w") as z:
            manifest = {"model": {"modelName": name, "modelVersion": version}}
            z.writestr("MAR-INF/MANIFEST.json", json.dumps(manifest))
    newest = resolve_model(TorchServeConfig(model_store=tmp_path))
    assert (newest.mar_file, newest.model_name, newest.model_version) == ("new-2.mar", "new", "2")
    named = resolve_model(
        TorchServeConfig(model_store=tmp_path, model_name="old", model_version="1")
    )
    assert named.mar_file == "old-1.mar"
    with pytest.raises(FileNotFoundError, match=r"no \.mar in"):
        resolve_model(TorchServeConfig(model_store=tmp_path / "empty"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1, 2]", "expected .* got list"),
        ('{"inference": "abc"}', "entry 'inference' has no string 'key'"),
        ('{"management": {"key": "m"}}', "no 'inference' key"),
        ("{not json", "cannot read TorchServe's key file"),
    ],
)
def test_a_key_file_of_the_wrong_shape_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "key_file.json"
    path.write_text(text)
    with pytest.raises(KeyFileError, match=message):
        inference_key(path)
    with pytest.raises(KeyFileError, match="not found: is TorchServe running there"):
        inference_key(tmp_path / "missing.json")


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
    # the model API is on for `make rollout`, on loopback and behind the management key
    assert props["enable_model_api"] == "true"
    assert props["management_address"] == "http://127.0.0.1:8081"
    assert props["inference_address"] == "http://127.0.0.1:8080"
    assert props["load_models"] == "m-2.mar"
    # the model API registers archives of the model store only (a .properties file: \\ = \)
    store = str(tmp_path.resolve()).replace("-", "\\\\-")
    assert props["allowed_urls"] == f"(?-i)file://{store}/[\\\\w.-]+\\\\.mar"
    model = json.loads(props["models"])["m"]["2"]
    # defaults: no TorchServe batching (the gateway merges), one worker per core
    cores = os.cpu_count() or 1
    assert (model["batchSize"], model["maxBatchDelay"], model["maxWorkers"]) == (1, 5, cores)
    with pytest.raises(FileNotFoundError, match=r"m-3\.mar not found"):
        write_properties(TorchServeConfig(model_store=tmp_path, model_name="m", model_version="3"))
    off = dataclasses.replace(cfg, model_api=False)
    assert "enable_model_api=false" in write_properties(off).read_text()
    # JVM flags: TorchServe's vmargs, spaces normalised; none at all when empty
    jvm = dataclasses.replace(cfg, jvm_args=" -XX:TieredStopAtLevel=1  -XX:+UseSerialGC ")
    assert (
        "\nvmargs=-XX:TieredStopAtLevel=1 -XX:+UseSerialGC\n" in write_properties(jvm).read_text()
    )
    assert "vmargs" not in write_properties(dataclasses.replace(cfg, jvm_args="")).read_text()


@pytest.fixture(scope="module")
def served(
    torchserve: Served, exported: tuple[Path, Path, str]
) -> tuple[TorchServeConfig, str, Sample]:
    cfg = torchserve[0]
    return cfg, inference_key(cfg.key_file), Sample(exported[0])


def _score(channel: grpc.Channel, cfg: TorchServeConfig, body: bytes, key: str) -> bytes:
    return score(channel, (cfg.model_name, cfg.model_version), body, CALL_TIMEOUT_S, key)


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
    probs = decode_response(_score(channel, cfg, sample.body(lo, hi), key))
    assert probs.shape == (hi - lo,)
    np.testing.assert_allclose(probs, sample.expected[lo:hi], atol=1e-6, rtol=0)


def _batches(cfg: TorchServeConfig) -> int:
    """handle() calls so far: the worker logs one line per batch it receives (the worker's
    lines reach TorchServe's stdout, cfg.log_file, with any log_config)."""
    return cfg.log_file.read_text(errors="replace").count("Backend received inference at")


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
        replies = list(pool.map(lambda body: _score(channel, cfg, body, key), bodies))
    for (a, b), reply in zip(cuts, replies, strict=True):
        np.testing.assert_allclose(decode_response(reply), sample.expected[a:b], atol=1e-6, rtol=0)
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
    # the prediction is the handler's message (REST answers 400). score() raises on it.
    request = predictions_request(cfg.model_name, "", truncated)
    reply, call = inference_stub(channel).Predictions.with_call(
        request, timeout=CALL_TIMEOUT_S, metadata=bearer(key)
    )
    assert call.code() == grpc.StatusCode.OK
    reason = f"invalid request: body is {len(truncated)} bytes".encode()
    assert reply.prediction.startswith(reason), reply.prediction
    with pytest.raises(RequestRejected, match=r"its header \(B=4, N=\d+\) needs"):
        _score(channel, cfg, truncated, key)
    rest = urllib.request.Request(
        f"http://{cfg.host}:{cfg.inference_port}/predictions/{cfg.model_name}",
        data=truncated,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/octet-stream"},
    )
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(rest, timeout=CALL_TIMEOUT_S)
    assert http_err.value.code == 400
    assert b"needs" in http_err.value.read()
    probs = decode_response(_score(channel, cfg, sample.body(0, 4), key))
    np.testing.assert_allclose(probs, sample.expected[0:4], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_a_poison_body_in_a_batch_fails_alone_and_its_batch_mates_score(
    served: tuple[TorchServeConfig, str, Sample], channel: grpc.Channel
) -> None:
    cfg, key, sample = served
    poison = b"{not json"  # once took its whole batch down (503 for every batch-mate)
    cuts = [(k * 10, k * 10 + k + 1) for k in range(7)]
    stub = inference_stub(channel)

    def call(body: bytes) -> bytes:
        request = predictions_request(cfg.model_name, "", body)
        reply = stub.Predictions(request, timeout=CALL_TIMEOUT_S, metadata=bearer(key))
        return bytes(reply.prediction)

    shared = 0  # rounds whose 8 requests TorchServe handed to one handle() call
    for _ in range(3):
        before = _batches(cfg)
        with ThreadPoolExecutor(max_workers=8) as pool:
            bad = pool.submit(call, poison)  # first in the batch: later slots must not shift
            time.sleep(0.005)
            good = [pool.submit(call, sample.body(a, b)) for a, b in cuts]
            replies = [f.result() for f in good]
        assert bad.result().startswith(b"invalid request: body starts with '{' but is not JSON")
        for (a, b), reply in zip(cuts, replies, strict=True):
            np.testing.assert_allclose(decode_response(reply), sample.expected[a:b], atol=1e-6)
        shared += _batches(cfg) - before == 1
        if shared:
            break
    assert shared, f"the 8 requests never shared a batch ({cfg.max_batch_delay_ms} ms window)"


@pytest.mark.slow
def test_every_torchserve_api_listens_on_loopback_only(
    served: tuple[TorchServeConfig, str, Sample], torchserve: Served
) -> None:
    cfg, proc = torchserve
    listening = {
        (c.laddr.ip, c.laddr.port)
        for p in process.group_members(proc.pid)
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }
    apis = [getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name.endswith("_port")]
    assert len(apis) == 5 and {port for _, port in listening} >= set(apis), listening
    for ip, port in listening:  # java reports IPv4 as IPv4-mapped IPv6 (::ffff:127.0.0.1)
        addr = ipaddress.ip_address(ip)
        addr = getattr(addr, "ipv4_mapped", None) or addr
        assert addr.is_loopback, f"port {port} listens on {ip}"


def test_the_java_frontend_runs_with_the_configured_flags(torchserve: Served) -> None:
    cfg, proc = torchserve
    java = [p for p in process.group_members(proc.pid) if p.name() == "java"]
    assert len(java) == 1, process.group_members(proc.pid)
    flags = cfg.jvm_args.split()  # the suite sets RECSYS_TS_JVM_ARGS (tests/conftest.py)
    assert flags and set(flags) <= set(java[0].cmdline()), (flags, java[0].cmdline())


@pytest.mark.slow
@pytest.mark.parametrize("token", ["", "wrong", "management"])
def test_calls_without_the_inference_key_are_rejected(
    served: tuple[TorchServeConfig, str, Sample], channel: grpc.Channel, token: str
) -> None:
    cfg, _, sample = served
    request = predictions_request(cfg.model_name, "", sample.body(0, 1))
    key = read_keys(cfg.key_file)["management"] if token == "management" else token
    metadata = bearer(key) if token else None
    with pytest.raises(grpc.RpcError) as err:
        inference_stub(channel).Predictions(request, timeout=CALL_TIMEOUT_S, metadata=metadata)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
    assert "Token Authorization failed" in (err.value.details() or "")


@pytest.mark.slow
def test_the_model_api_registers_archives_of_the_model_store_only(
    torchserve: Served, tmp_path: Path
) -> None:
    """``allowed_urls``: the management key cannot make TorchServe fetch an archive (handler
    code it would run) from a server or from a file outside the model store; an archive of the
    store, registered by name as ``make rollout`` does, still loads."""
    cfg, _ = torchserve
    outside = tmp_path / "evil-1.mar"
    shutil.copy(cfg.model_store / cfg.mar, outside)  # a valid archive, in the wrong place
    for url in (
        "http://127.0.0.1:9/evil-1.mar",
        "https://example.com/evil-1.mar",
        outside.as_uri(),
    ):
        with pytest.raises(manage.ManageError, match=r"does not match any allowed URL"):
            manage.register(cfg, "evil", "1", url, timeout=CALL_TIMEOUT_S)
    assert manage.describe(cfg, "evil") is None
    assert not (cfg.model_store / outside.name).exists()  # nothing copied into the store
    manage.register(cfg, "copy", cfg.model_version, cfg.mar, timeout=120)
    try:
        assert manage.versions(cfg, "copy") == {cfg.model_version: 1}
    finally:
        manage.unregister(cfg, "copy", cfg.model_version)
