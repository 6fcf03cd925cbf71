"""Client of the gateway: Criteo TSV rows -> ``recsys.v1.ScoreRequest`` -> scores.

``python -m serving.tools.client [--data rows.tsv]`` (``recsys-score``, ``make score``) prints one
probability per row (with the label when the file has one); without ``--data``, of the held-out
rows of the data the served model was trained on (serving/tools/evaldata.py). Which rows of
which file goes to stderr first. Also a library for tests, the
load generator and the supervisor: :func:`parse_rows`, :func:`build_request`,
:class:`RankerClient`, :func:`gateway_status`. TLS, mutual TLS and the token: the flags below, or
``RECSYS_CLIENT_TLS_*`` and ``RECSYS_GATEWAY_TOKEN_FILE`` (serving/tools/channel.py). Serving never
imports training: the TSV parser here is deliberately small (label optional; 13 ints; 26 hex
ids; empty = missing).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recsys_stack.config import ConfigError, parse
from serving.gateway.auth import AuthError, call_metadata, client_token
from serving.gateway.config import ChannelConfig, ClientConfig
from serving.stubs import ranker_pb2, ranker_pb2_grpc
from serving.tools.channel import metadata, open_channel
from serving.tools.evaldata import NoDefault, Window, default_window, window_lines

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
    """Blocking client; ``score`` returns float32[B]. ``channel``: TLS and the token file
    (:mod:`serving.tools.channel`; None = plaintext); ``token``: the bearer token to send (None =
    ``channel``'s, else :func:`serving.gateway.auth.client_token`: ``RECSYS_GATEWAY_TOKEN_FILE``
    or the file ``make serve`` writes, when there is one; "" = none)."""

    def __init__(
        self,
        target: str,
        timeout: float = 5.0,
        token: str | None = None,
        channel: ChannelConfig | None = None,
    ) -> None:
        self.channel = open_channel(target, channel)
        self.stub = ranker_pb2_grpc.RankerStub(self.channel)
        self.timeout = timeout
        if token is None:
            token = client_token(channel.token_file if channel is not None else "")
        self.metadata = call_metadata(token)

    def score(self, request: ranker_pb2.ScoreRequest) -> np.ndarray:
        reply = self.stub.Score(request, timeout=self.timeout, metadata=self.metadata)
        return np.asarray(reply.scores, dtype=np.float32)

    def close(self) -> None:
        self.channel.close()


def health(
    target: str, timeout: float = 1.0, channel: ChannelConfig | None = None
) -> tuple[str, str]:
    """``(status, why)`` of the gateway's grpc.health.v1 service: SERVING / NOT_SERVING /
    UNREACHABLE, and for UNREACHABLE the gRPC code and details (a refused handshake, a missing
    token). ``channel``: TLS and the token (None = plaintext, no token); a TLS or token file
    that cannot be read raises AuthError."""
    with open_channel(target, channel) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout,
                metadata=metadata(channel),
            )  # fmt: skip
        except grpc.RpcError as e:
            return "UNREACHABLE", f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)), ""


def gateway_status(target: str, timeout: float = 1.0, channel: ChannelConfig | None = None) -> str:
    """SERVING / NOT_SERVING / UNREACHABLE (:func:`health` without the reason)."""
    return health(target, timeout, channel)[0]


def rows_window(cfg: ClientConfig) -> Window:
    """The first ``cfg.rows`` rows of ``cfg.data``, else of the served model's held-out rows."""
    if cfg.data is None:
        return default_window(cfg.workdir, "", cfg.rows, "--data")
    return Window([cfg.data], 0, cfg.rows)


def read_rows(window: Window) -> Rows:
    """The rows of ``window``, parsed."""
    return parse_rows(list(window_lines(window)), ", ".join(map(str, window.paths)))


def rpc_error(e: grpc.RpcError, target: str) -> str:
    """A failed call in one line; no gateway at ``target`` says how to start one."""
    code, details = e.code(), e.details() or ""  # type: ignore[attr-defined]
    refused = "failed to connect" in details and "handshake" not in details.lower()
    if code == grpc.StatusCode.UNAVAILABLE and refused:  # nothing listens there
        return (
            f"UNAVAILABLE: no gateway answers at {target}: start the stack with "
            "`make serve` (`make status` shows what runs)"
        )
    return f"{code.name}: {details}"


def score_rows(cfg: ClientConfig, rows: Rows) -> Iterable[str]:
    """``index<TAB>probability[<TAB>label=y]`` per row, ``cfg.batch`` rows per request."""
    client = RankerClient(cfg.target, cfg.timeout_s, channel=cfg)
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
        window = rows_window(cfg)
        rows = read_rows(window)
        print(f"scoring {window.describe()}", file=sys.stderr, flush=True)
    except (ConfigError, OSError, ValueError, NoDefault) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        for line in score_rows(cfg, rows):
            print(line)
    except (AuthError, OSError, ValueError) as e:  # token or TLS files
        print(f"error: {e}", file=sys.stderr)
        return 2
    except grpc.RpcError as e:
        print(f"error: {rpc_error(e, cfg.target)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
