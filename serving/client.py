"""Client of the gateway: Criteo TSV rows -> ``recsys.v1.ScoreRequest`` -> scores.

``python -m serving.client --data rows.tsv`` prints one probability per row (with the label
when the file has one). Also a library for tests and load tests: :func:`parse_rows`,
:func:`build_request`, :class:`RankerClient`. Serving never imports training: the TSV parser
here is deliberately small (label optional; 13 ints; 26 hex ids; empty = missing).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from serving.protos import ensure_generated

ensure_generated()
from serving._gen.recsys.v1 import ranker_pb2, ranker_pb2_grpc  # noqa: E402

DENSE = [f"I{i}" for i in range(1, 14)]
SPARSE = [f"C{i}" for i in range(1, 27)]


@dataclass
class Rows:
    labels: np.ndarray | None  # int8[B] when the file has labels
    dense: np.ndarray  # float32[B, 13]
    sparse: np.ndarray  # int64[B, 26], -1 = missing


def parse_rows(lines: Iterable[str], source: str = "<rows>") -> Rows:
    """TSV lines with 40 (label first) or 39 fields -> arrays; errors name line and column."""
    labels, dense, sparse = [], [], []
    for n, line in enumerate(lines, 1):
        fields = line.rstrip("\r\n").split("\t")
        if len(fields) not in (39, 40):
            raise ValueError(
                f"{source}:{n}: expected 39 or 40 tab-separated fields, got {len(fields)}"
            )
        if len(fields) == 40:
            labels.append(int(fields[0]))
            fields = fields[1:]
        try:
            dense.append([float(int(x)) if x else 0.0 for x in fields[:13]])
        except ValueError:
            raise ValueError(f"{source}:{n}: a dense value is not an integer") from None
        row = []
        for j, x in enumerate(fields[13:]):
            try:
                row.append(int(x, 16) if x else -1)
            except ValueError:
                raise ValueError(f"{source}:{n}: column {SPARSE[j]}: {x!r} is not hex") from None
        sparse.append(row)
    has_labels = len(labels) == len(dense) and labels
    return Rows(
        labels=np.asarray(labels, dtype=np.int8) if has_labels else None,
        dense=np.asarray(dense, dtype=np.float32).reshape(-1, 13),
        sparse=np.asarray(sparse, dtype=np.int64).reshape(-1, 26),
    )


def build_request(
    dense: np.ndarray, sparse: np.ndarray, model_version: str = ""
) -> ranker_pb2.ScoreRequest:
    """``float32[B,13]`` raw dense + ``int64[B,26]`` raw ids (-1 = missing) -> ScoreRequest."""
    b = dense.shape[0]
    features = []
    for j, name in enumerate(SPARSE):
        col = sparse[:, j]
        present = col >= 0
        features.append(
            ranker_pb2.SparseFeature(
                name=name, ids=col[present].tolist(), lengths=present.astype(np.int32).tolist()
            )
        )
    return ranker_pb2.ScoreRequest(
        num_examples=b,
        dense=dense.reshape(-1).tolist(),
        sparse=features,
        model_version=model_version,
    )


class RankerClient:
    """Blocking client; ``score`` returns float32[B]."""

    def __init__(self, target: str, timeout: float = 5.0) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = ranker_pb2_grpc.RankerStub(self.channel)
        self.timeout = timeout

    def score(self, request: ranker_pb2.ScoreRequest) -> np.ndarray:
        reply = self.stub.Score(request, timeout=self.timeout)
        return np.asarray(reply.scores, dtype=np.float32)

    def close(self) -> None:
        self.channel.close()


def main(argv: Sequence[str] | None = None) -> int:
    import os

    p = argparse.ArgumentParser(
        prog="python -m serving.client", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--target", default=f"127.0.0.1:{os.environ.get('RECSYS_GATEWAY_PORT', '50051')}"
    )
    p.add_argument("--data", type=Path, required=True, help="Criteo TSV (label column optional)")
    p.add_argument("--rows", type=int, default=10, help="rows to score (default 10)")
    p.add_argument("--batch", type=int, default=100, help="examples per request")
    ns = p.parse_args(argv)
    try:
        with ns.data.open() as f:
            lines = [line for _, line in zip(range(ns.rows), f, strict=False)]
        rows = parse_rows(lines, str(ns.data))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    client = RankerClient(ns.target)
    try:
        for lo in range(0, len(rows.dense), ns.batch):
            hi = min(lo + ns.batch, len(rows.dense))
            scores = client.score(build_request(rows.dense[lo:hi], rows.sparse[lo:hi]))
            for i, s in enumerate(scores, lo):
                label = f"\tlabel={int(rows.labels[i])}" if rows.labels is not None else ""
                print(f"{i}\t{s:.6f}{label}")
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
