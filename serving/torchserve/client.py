"""Calls to TorchServe's gRPC inference API: the one place a ``PredictionsRequest`` is built.

The gateway's backends (async), its health probe, the tests and the benchmark (blocking) all
send RSB1 bodies (``serving.worker.codec``) through :func:`predictions_request` with :func:`bearer`
metadata, and read the reply through :func:`prediction_bytes`. No torch, no psutil.
"""

from __future__ import annotations

import functools
from typing import Any

import grpc

from serving.stubs import generated
from serving.torchserve.keys import bearer, inference_key
from serving.worker.codec import REJECTION

with generated():
    from serving._gen import inference_pb2, inference_pb2_grpc


class RequestRejected(ValueError):
    """The handler refused the request (e.g. a malformed body); the message is its reason."""


def predictions_request(
    model_name: str, model_version: str, body: bytes
) -> inference_pb2.PredictionsRequest:
    """One ``Predictions`` request carrying ``body`` as the ``data`` input."""
    return inference_pb2.PredictionsRequest(
        model_name=model_name, model_version=model_version, input={"data": body}
    )


PREDICTIONS = "/org.pytorch.serve.grpc.inference.InferenceAPIsService/Predictions"


def _varint(n: int) -> bytes:
    if n < 0x200000:  # up to 3 bytes (bodies below 2 MB): no loop, on every backend call
        if n < 0x80:
            return bytes((n,))
        if n < 0x4000:
            return bytes((n & 0x7F | 0x80, n >> 7))
        return bytes((n & 0x7F | 0x80, (n >> 7) & 0x7F | 0x80, n >> 14))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field_head(tag: int, size: int) -> bytes:
    """A length-delimited protobuf field's tag and length (its ``size`` bytes follow)."""
    return bytes((tag,)) + _varint(size)


def _field(tag: int, data: bytes) -> bytes:
    return field_head(tag, len(data)) + data


def predictions_envelope(model_name: str, model_version: str, body_size: int) -> bytes:
    """The bytes of a serialized ``PredictionsRequest`` (``input={"data": body}``) that come
    before its body: ``envelope + body`` is what :func:`predictions_request` serializes to.

    The gateway writes the envelope and the body into one buffer and sends it as raw bytes:
    protobuf's message for a 13 MB body cost ~25 ms of copies on the event loop (building it
    and serializing it), while health checks and refusals waited."""
    entry_head = b"\x0a\x04data\x12" + _varint(body_size)  # key = 1 ("data"), value = 2
    inner = _varint(len(entry_head) + body_size)
    return b"".join((_names(model_name, model_version), b"\x1a", inner, entry_head))  # input = 3


@functools.lru_cache(maxsize=64)
def _names(model_name: str, model_version: str) -> bytes:
    """A ``PredictionsRequest``'s model_name (1) and model_version (2) fields."""
    out = _field(0x0A, model_name.encode())
    return out + (_field(0x12, model_version.encode()) if model_version else b"")


def inference_stub(channel: grpc.Channel | grpc.aio.Channel) -> Any:
    """``InferenceAPIsServiceStub`` on ``channel`` (blocking or asyncio)."""
    return inference_pb2_grpc.InferenceAPIsServiceStub(channel)


def prediction_bytes(reply: inference_pb2.PredictionResponse) -> bytes:
    """The reply's prediction; the handler's refusal raises :class:`RequestRejected`.

    TorchServe 0.12's gRPC ``Predictions`` drops the per-request status the handler sets (REST
    answers 400) and returns OK with the handler's message as the prediction.
    """
    prediction = bytes(reply.prediction)
    if prediction.startswith(REJECTION):
        raise RequestRejected(prediction.decode(errors="replace"))
    return prediction


def score(
    channel: grpc.Channel,
    model: tuple[str, str],
    body: bytes,
    timeout: float,
    key: str,
) -> bytes:
    """One blocking ``Predictions`` call of ``model`` = ``(name, version)``; the raw reply.

    Transport, auth (PERMISSION_DENIED) and server errors surface as ``grpc.RpcError``.
    """
    request = predictions_request(*model, body)
    reply = inference_stub(channel).Predictions(request, timeout=timeout, metadata=bearer(key))
    return prediction_bytes(reply)


__all__ = [
    "RequestRejected",
    "bearer",
    "inference_key",
    "inference_pb2",
    "inference_pb2_grpc",
    "inference_stub",
    "prediction_bytes",
    "predictions_request",
    "score",
]
