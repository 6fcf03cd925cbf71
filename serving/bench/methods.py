"""One client per method: ``connect(payload)`` -> a per-thread ``(call, close)`` pair.

Each client thread gets its own connection (HTTP keep-alive, or a gRPC channel with its own
subchannel pool, so threads never share a TCP connection) and a request built beforehand. A call
returns how many scores came back, read the way a user reads them (JSON, float32 bytes,
protobuf floats), so a wrong answer cannot pass for a fast one.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from typing import Any

import grpc

from serving.bench.model import Model, Payload
from serving.stubs import ranker_pb2_grpc
from serving.torchserve.client import bearer, inference_stub, prediction_bytes

Call = Callable[[], int]
Connect = Callable[[Payload], tuple[Call, Callable[[], None]]]
TIMEOUT_S = 120.0
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


def in_process(model: Model, threads: int) -> Connect:
    """The served artifact's forward in this process, ``threads`` intra-op threads (a worker's)."""
    import fbgemm_gpu  # noqa: F401  registers the fbgemm ops the artifact calls
    import torch

    from serving.worker.scoring import load_artifact

    torch.set_num_threads(threads)
    scripted = load_artifact(model.artifact, model.variant, torch.device("cpu"), None)

    def connect(p: Payload) -> tuple[Call, Callable[[], None]]:
        x = (torch.from_numpy(p.dense), torch.from_numpy(p.values), torch.from_numpy(p.lengths))

        def call() -> int:
            with torch.inference_mode():
                return int(scripted(*x).numel())

        return call, lambda: None

    return connect


def plain_rest(host: str, port: int, path: str, key: str) -> Connect:
    """TorchServe's REST inference API with a JSON body, one keep-alive connection per thread."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}

    def connect(p: Payload) -> tuple[Call, Callable[[], None]]:
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)

        def call() -> int:
            conn.request("POST", path, body=p.plain_json, headers=headers)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {body[:200]!r}")
            return len(json.loads(body))

        return call, conn.close

    return connect


def _channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=OWN_CONNECTION)


def torchserve_grpc(target: str, key: str) -> Connect:
    """TorchServe's gRPC ``Predictions`` with the project's RSB1 body, no gateway (or the
    same call through the bench's relay, ``target`` = the relay)."""
    metadata = bearer(key)

    def connect(p: Payload) -> tuple[Call, Callable[[], None]]:
        channel = _channel(target)
        predictions = inference_stub(channel).Predictions

        def call() -> int:
            reply = predictions(p.predictions, timeout=TIMEOUT_S, metadata=metadata)
            return len(prediction_bytes(reply)) // 4

        return call, channel.close

    return connect


def gateway(target: str) -> Connect:
    """``recsys.v1.Ranker/Score`` on the gateway (which calls TorchServe's gRPC API)."""

    def connect(p: Payload) -> tuple[Call, Callable[[], None]]:
        channel = _channel(target)
        score: Any = ranker_pb2_grpc.RankerStub(channel).Score

        def call() -> int:
            return len(score(p.score, timeout=TIMEOUT_S).scores)

        return call, channel.close

    return connect
