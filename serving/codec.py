"""Compact binary request/response bodies between the gateway and the TorchServe handler.

Request (little-endian), ``RSB1``::

    magic b"RSB1" | uint32 B | uint32 D | uint32 F | uint32 N
    float32[B*D] dense (row-major) | int32[F*B] lengths (feature-major) | int64[N] ids

Response: ``float32[B]`` probabilities. Decoding is zero-copy (``torch.frombuffer``) and
checks every size against the header, so a truncated or inconsistent body is named precisely
instead of crashing a worker. No torch-free path is needed: both ends run torch.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

MAGIC = b"RSB1"
HEADER = struct.Struct("<4sIIII")
# The handler's answer to a body it refuses. TorchServe 0.12's gRPC Predictions drops the
# per-request status a handler sets (REST answers 400) and returns OK with this text as the
# prediction, so readers must check for it before decoding scores.
REJECTION = b"invalid request: "


class CodecError(ValueError):
    """A request body that does not decode; the message says what is wrong."""


def encode_request(dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> bytes:
    """``dense f32[B,D]``, ``values i64[N]``, ``lengths i32[F,B]`` -> bytes."""
    b, d = dense.shape
    f = lengths.shape[0]
    header = HEADER.pack(MAGIC, b, d, f, values.numel())
    return b"".join(
        [
            header,
            dense.to(torch.float32).contiguous().numpy().tobytes(),
            lengths.to(torch.int32).contiguous().numpy().tobytes(),
            values.to(torch.int64).contiguous().numpy().tobytes(),
        ]
    )


def decode_request(
    body: bytes | bytearray, dense_count: int, sparse_count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bytes -> ``(dense f32[B,D], values i64[N], lengths i32[F,B])``, checked against the schema."""
    if len(body) < HEADER.size:
        raise CodecError(f"body of {len(body)} bytes is shorter than the {HEADER.size}-byte header")
    magic, b, d, f, n = HEADER.unpack_from(body)
    if magic != MAGIC:
        raise CodecError(f"bad magic {magic!r} (expected {MAGIC!r})")
    if d != dense_count or f != sparse_count:
        raise CodecError(
            f"body has {d} dense and {f} sparse features; the model takes {dense_count} and {sparse_count}"
        )
    if b == 0:
        raise CodecError("empty request: 0 examples")
    sizes = (4 * b * d, 4 * f * b, 8 * n)
    expected = HEADER.size + sum(sizes)
    if len(body) != expected:
        raise CodecError(f"body is {len(body)} bytes; its header (B={b}, N={n}) needs {expected}")
    buf = memoryview(body)
    off = HEADER.size
    dense = torch.frombuffer(buf, dtype=torch.float32, count=b * d, offset=off).view(b, d)
    off += sizes[0]
    lengths = torch.frombuffer(buf, dtype=torch.int32, count=f * b, offset=off).view(f, b)
    off += sizes[1]
    values = (
        torch.frombuffer(buf, dtype=torch.int64, count=n, offset=off)
        if n
        else torch.empty(0, dtype=torch.int64)
    )
    if bool((lengths < 0).any()):
        raise CodecError("negative length")
    if int(lengths.sum()) != n:
        raise CodecError(f"lengths sum to {int(lengths.sum())} but the body has {n} ids")
    return dense, values, lengths


def encode_response(probs: torch.Tensor) -> bytes:
    return probs.to(torch.float32).contiguous().numpy().tobytes()


def decode_response(body: bytes) -> torch.Tensor:
    if body.startswith(REJECTION):
        raise CodecError(body.decode(errors="replace"))
    if len(body) % 4:
        raise CodecError(f"response of {len(body)} bytes is not a float32 array")
    return torch.frombuffer(bytearray(body), dtype=torch.float32)


def decode_json(
    obj: object, dense_names: list[str], sparse_names: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TorchServe's default REST style, ``{"instances": [{"dense": [..13..], "sparse": {"C1":
    [ids], ...}}, ...]}`` -> the same tensors as :func:`decode_request`. Kept for users who
    call TorchServe directly and as the benchmark's baseline; the gateway sends RSB1."""
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("instances"), list)
        or not obj["instances"]
    ):
        raise CodecError('expected {"instances": [{"dense": [...], "sparse": {...}}, ...]}')
    rows = obj["instances"]
    index = {name: k for k, name in enumerate(sparse_names)}
    dense = torch.zeros(len(rows), len(dense_names), dtype=torch.float32)
    ids: list[list[int]] = [[] for _ in sparse_names]
    lengths = torch.zeros(len(sparse_names), len(rows), dtype=torch.int32)
    for i, row in enumerate(rows):
        try:
            values = row["dense"]
            if len(values) != len(dense_names):
                raise CodecError(
                    f"instances[{i}].dense has {len(values)} values; the model takes {len(dense_names)}"
                )
            dense[i] = torch.tensor(values, dtype=torch.float32)
            for name, feature_ids in row.get("sparse", {}).items():
                if name not in index:
                    raise CodecError(f"instances[{i}].sparse: unknown feature '{name}'")
                k = index[name]
                ids[k].extend(int(x) for x in feature_ids)
                lengths[k, i] = len(feature_ids)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CodecError):
                raise
            raise CodecError(f"instances[{i}]: {type(e).__name__}: {e}") from None
    values_t = torch.tensor([x for per in ids for x in per], dtype=torch.int64)
    return dense, values_t, lengths


def slice_examples(
    dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Examples ``[lo, hi)`` of an encoded batch, still feature-major."""
    by_feature = torch.split(values, lengths.sum(dim=1).tolist())
    parts = [
        f[int(ln[:lo].sum()) : int(ln[:hi].sum())]
        for f, ln in zip(by_feature, lengths, strict=True)
    ]
    return dense[lo:hi].contiguous(), torch.cat(parts), lengths[:, lo:hi].contiguous()


def to_rows(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Feature-major ``values``/``lengths int[F,B]`` with at most one id per (feature, example)
    -> row-major raw ids ``int64[B, F]``, -1 = missing: what a client starts from."""
    if (lengths > 1).any():
        raise CodecError("to_rows needs at most one id per feature and example")
    sparse = np.full(lengths.shape[::-1], -1, dtype=np.int64)
    present = lengths.T > 0  # [B, F]
    sparse.T[present.T] = values  # feature-major order, like the encoding
    return sparse
