"""Client of the gateway: Criteo TSV rows -> ``recsys.v1.ScoreRequest`` -> scores.

``python -m serving.tools.client --data rows.tsv`` (``recsys-score``, ``make score``) prints one
probability per row (with the label when the file has one). Also a library for tests, the
load generator and the supervisor: :func:`parse_rows`, :func:`build_request`,
:class:`RankerClient`, :func:`gateway_status`. Serving never imports training: the TSV parser
here is deliberately small (label optional; 13 ints; 26 hex ids; empty = missing).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recsys_stack.config import ConfigError, parse
from serving.gateway.auth import AuthError, call_metadata, client_token
from serving.gateway.config import ClientConfig
from serving.stubs import ranker_pb2, ranker_pb2_grpc

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


def channel_credentials(cfg: ClientConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials from ``cfg.tls_*`` (None = plaintext); a client cert for mutual TLS."""
    if not (cfg.tls_ca or cfg.tls_cert):
        return None
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ValueError("tls_cert and tls_key go together")

    def pem(path: str) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(pem(cfg.tls_ca), pem(cfg.tls_key), pem(cfg.tls_cert))


class RankerClient:
    """Blocking client; ``score`` returns float32[B]. ``token``: the gateway's bearer token
    (None = :func:`serving.gateway.auth.client_token`: ``RECSYS_GATEWAY_TOKEN_FILE`` or the file
    ``make serve`` writes, when there is one; "" = none); ``credentials``: TLS (None =
    plaintext)."""

    def __init__(
        self,
        target: str,
        timeout: float = 5.0,
        token: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        if credentials is None:
            self.channel = grpc.insecure_channel(target)
        else:
            self.channel = grpc.secure_channel(target, credentials)
        self.stub = ranker_pb2_grpc.RankerStub(self.channel)
        self.timeout = timeout
        self.metadata = call_metadata(client_token() if token is None else token)

    def score(self, request: ranker_pb2.ScoreRequest) -> np.ndarray:
        reply = self.stub.Score(request, timeout=self.timeout, metadata=self.metadata)
        return np.asarray(reply.scores, dtype=np.float32)

    def close(self) -> None:
        self.channel.close()


def gateway_status(
    target: str, timeout: float = 1.0, metadata: tuple[tuple[str, str], ...] = ()
) -> str:
    """SERVING / NOT_SERVING / UNREACHABLE of the gateway's grpc.health.v1 service
    (``metadata``: a bearer token, for a gateway with ``auth.protect_health``)."""
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout, metadata=metadata
            )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    except grpc.RpcError:
        return "UNREACHABLE"


def read_rows(cfg: ClientConfig) -> Rows:
    """The first ``cfg.rows`` rows of ``cfg.data``."""
    if cfg.data is None:
        raise ValueError("no rows to score: pass --data FILE.tsv")
    with cfg.data.open() as f:
        lines = [line for _, line in zip(range(cfg.rows), f, strict=False)]
    return parse_rows(lines, str(cfg.data))


def score_rows(cfg: ClientConfig, rows: Rows) -> Iterable[str]:
    """``index<TAB>probability[<TAB>label=y]`` per row, ``cfg.batch`` rows per request."""
    client = RankerClient(
        cfg.target, cfg.timeout_s, client_token(cfg.token_file), channel_credentials(cfg)
    )
    try:
        for lo in range(0, len(rows.dense), cfg.batch):
            hi = min(lo + cfg.batch, len(rows.dense))
            scores = client.score(build_request(rows.dense[lo:hi], rows.sparse[lo:hi]))
            for i, s in enumerate(scores, lo):
                label = f"\tlabel={int(rows.labels[i])}" if rows.labels is not None else ""
                yield f"{i}\t{s:.6f}{label}"
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``recsys-score``)."""
    try:
        cfg = parse(ClientConfig, argv, "python -m serving.tools.client", __doc__.split("\n\n")[0])
        rows = read_rows(cfg)
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        for line in score_rows(cfg, rows):
            print(line)
    except (AuthError, OSError, ValueError) as e:  # token or TLS files
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
