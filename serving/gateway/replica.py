"""One TorchServe replica as the gateway sees it (:class:`Backend`: channel, key, health and
load) and its health probe: a one-example request whose answer must be one probability."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from serving.gateway.localsock import SocketChannel
from serving.gateway.wire import prediction_of
from serving.lite.frames import SCHEME
from serving.torchserve.client import PREDICTIONS
from serving.torchserve.keys import KeySource
from serving.worker.codec import CodecError, decode_response, encode_request

# a backend's key file is looked at this often at most (a stat per call cost ~40 us under load);
# TorchServe takes longer than this to restart with new keys, and a refused key is re-read
KEY_RECHECK_S = 1.0


def probe_body(dense: int, sparse: int) -> bytes:
    """A one-example request (zeros, no ids) of the schema's shape: the health probe."""
    return encode_request(
        np.zeros((1, dense), np.float32), np.zeros(0, np.int64), np.zeros((sparse, 1), np.int32)
    )


def probe_problem(prediction: bytes) -> str:
    """ "" when a probe's answer is one finite probability in [0, 1], else what is wrong."""
    try:
        scores = decode_response(prediction)
    except CodecError as e:  # e.g. the handler refuses the request: wrong schema in the .mar
        return f"the probe's answer does not decode: {e}"
    if scores.size != 1 or not (0.0 <= float(scores[0]) <= 1.0):
        return f"the probe's answer is {scores[:4].tolist()}, not one probability in [0, 1]"
    return ""


@dataclass
class Backend:
    target: str
    keys: KeySource
    channel: grpc.aio.Channel | SocketChannel
    predictions: Any
    """``Predictions`` taking a serialized request (``predictions_envelope`` + body)."""
    ready: dict[str, bool] = field(default_factory=dict)
    """Per model version: in rotation (its last probe passed and no outage since)."""
    calls: int = field(default=0)
    in_flight: int = 0
    problems: dict[str, str] = field(default_factory=dict)
    """Per model version: why its last probe failed (absent = it passed)."""
    stalled: bool = False
    """A call of it had to be hedged: new calls prefer the others until a probe passes."""
    served: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per model version in rotation: what its workers serve (device, variant, dtype), as
    the handler describes it; asked again after the backend leaves rotation."""
    workers: int = 0
    """TorchServe workers on the replica (every version's), as its handler last counted them
    in a describe answer; 0 = not said yet."""

    key_due: float = 0.0
    key_metadata: tuple[tuple[str, str], ...] = ()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata with the current key (:data:`KEY_RECHECK_S`); KeyFileError if the
        key file cannot be read."""
        now = time.monotonic()
        if now >= self.key_due:
            self.key_metadata = self.keys.metadata()
            self.key_due = now + KEY_RECHECK_S
        return self.key_metadata

    @property
    def healthy(self) -> bool:
        """In rotation for at least one version."""
        return any(self.ready.values())


def connect(target: str, key_file: Path, options: Sequence[tuple[str, Any]]) -> Backend:
    """A backend for ``target`` (its own channel; calls take serialized requests): a lite
    worker's socket for ``lite:PATH`` (serving/gateway/localsock.py), else a gRPC channel."""
    if target.startswith(SCHEME):
        sock = SocketChannel(target[len(SCHEME) :])
        return Backend(target, KeySource(key_file), sock, sock.predictions)
    channel = grpc.aio.insecure_channel(target, options=options)
    predictions = channel.unary_unary(
        PREDICTIONS, request_serializer=None, response_deserializer=prediction_of
    )
    return Backend(target, KeySource(key_file), channel, predictions)
