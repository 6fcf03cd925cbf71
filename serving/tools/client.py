"""Client of the gateway: Criteo TSV rows -> ``recsys.v1.ScoreRequest`` -> scores.

``python -m serving.tools.client [--data rows.tsv]`` (``recsys-score``, ``make score``) prints one
probability per row (with the label when the file has one); without ``--data``, of the rows the
served model never trained on, as its schema.json records them (serving/tools/evaldata.py).
Which rows of which file, and why, goes to stderr first. Also a library for tests, the
load generator and the supervisor: :func:`parse_rows`, :func:`build_request`,
:class:`RankerClient`, :func:`gateway_status`. TLS, mutual TLS and the token: the flags below, or
``RECSYS_CLIENT_TLS_*`` and ``RECSYS_GATEWAY_TOKEN_FILE`` (serving/tools/channel.py). Rows are
read by the trainer's rules (:mod:`recsys_stack.criteo_rows`, shared since serving never imports
training), except that the label is optional (39 fields, the same for every row); the first
malformed row is a one-line error naming its file and line.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from recsys_stack.config import ConfigError, parse
from recsys_stack.criteo_rows import DENSE_NAMES, SPARSE_NAMES, ParsedRows, scan_rows
from recsys_stack.online import OPT_OUT_HEADER
from serving.gateway.auth import AuthError, call_metadata, client_token
from serving.gateway.config import ChannelConfig, ClientConfig
from serving.stubs import ranker_pb2, ranker_pb2_grpc
from serving.tools.channel import metadata, open_channel
from serving.tools.evaldata import NoDefault, Window, default_window, window_rows

DENSE, SPARSE = DENSE_NAMES, SPARSE_NAMES
Rows = ParsedRows  # labels int8[B] | None, dense float32[B, 13], sparse int64[B, 26] (-1 = missing)
READ_BATCH = 65536  # rows parsed at a time when reading a whole window


def parse_rows(lines: Iterable[str | bytes], source: str = "<rows>", first_line: int = 1) -> Rows:
    """TSV lines (the first at line ``first_line`` of ``source``) with 40 fields (label first) or
    39 (none), the same for every row -> arrays; :class:`~recsys_stack.criteo_rows.RowError`
    (a ValueError: ``source:line: column C7: 'zz12' is not hex``) at the first malformed row."""
    raw = (x.encode() if isinstance(x, str) else x for x in lines)
    return Rows.concat(
        list(scan_rows(raw, source, READ_BATCH, labelled=None, first_line=first_line))
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
    """Blocking client; ``score`` returns float32[B]. ``log`` False: calls the gateway's
    feature log leaves out (``x-recsys-feature-log: off``). ``channel``: TLS and the token file
    (:mod:`serving.tools.channel`; None = plaintext); ``token``: the bearer token to send (None =
    ``channel``'s, else :func:`serving.gateway.auth.client_token`: ``RECSYS_GATEWAY_TOKEN_FILE``
    or the file ``make serve`` writes, when there is one; "" = none)."""

    def __init__(
        self,
        target: str,
        timeout: float = 5.0,
        token: str | None = None,
        channel: ChannelConfig | None = None,
        log: bool = True,
    ) -> None:
        self.channel = open_channel(target, channel)
        self.stub = ranker_pb2_grpc.RankerStub(self.channel)
        self.timeout = timeout
        if token is None:
            token = client_token(channel.token_file if channel is not None else "")
        # log False: the gateway's feature log leaves these calls out (rows scored by a tool
        # are not traffic: with no click they would all train as 0s)
        self.metadata = call_metadata(token) + (() if log else ((OPT_OUT_HEADER, "off"),))

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
    """The first ``cfg.rows`` rows of ``cfg.data``, else of the served model's unseen rows."""
    if cfg.data is None:
        return default_window(cfg.workdir, "", cfg.rows, "--data")
    return Window([cfg.data], 0, cfg.rows)


def read_rows(window: Window) -> Rows:
    """The rows of ``window``, parsed (:func:`serving.tools.evaldata.window_rows`); a
    ValueError naming the files when there are none."""
    rows = Rows.concat([r for _, r in window_rows(window, READ_BATCH, labelled=None)])
    if not len(rows):
        raise ValueError(f"{', '.join(map(str, window.paths))}: no rows to score")
    return rows


def rpc_error(e: grpc.RpcError, target: str) -> str:
    """A failed call in one line; no gateway at ``target`` says how to start one."""
    code, details = e.code(), e.details() or ""  # type: ignore[attr-defined]
    said = details.lower()  # pick_first: "failed to connect to all addresses"; round_robin:
    # "connections to all backends failing; ... Failed to connect to remote host: ..."
    refused = "failed to connect" in said and "handshake" not in said
    if code == grpc.StatusCode.UNAVAILABLE and refused:  # nothing listens there
        return (
            f"UNAVAILABLE: no gateway answers at {target}: start the stack with "
            "`make serve` (`make status` shows what runs)"
        )
    return f"{code.name}: {details}"


def score_rows(cfg: ClientConfig, rows: Rows, first: int = 0) -> Iterable[str]:
    """``row<TAB>probability[<TAB>label=y]`` per row, ``cfg.batch`` rows per request; ``row``
    counts as the "scoring rows A..B" line does, from 1, the window's ``first`` row before."""
    client = RankerClient(cfg.target, cfg.timeout_s, channel=cfg, log=False)
    try:
        for lo in range(0, len(rows.dense), cfg.batch):
            hi = min(lo + cfg.batch, len(rows.dense))
            scores = client.score(build_request(rows.dense[lo:hi], rows.sparse[lo:hi]))
            for i, s in enumerate(scores, lo):
                label = f"\tlabel={int(rows.labels[i])}" if rows.labels is not None else ""
                yield f"{first + i + 1}\t{s:.6f}{label}"
    finally:
        client.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``recsys-score``)."""
    try:
        cfg = parse(ClientConfig, argv, "python -m serving.tools.client", __doc__.split("\n\n")[0])
        window = rows_window(cfg)
        rows = read_rows(window)
        window = dataclasses.replace(window, count=len(rows))  # the rows really read
        print(f"scoring {window.describe()}", file=sys.stderr, flush=True)
    except (ConfigError, OSError, ValueError, NoDefault) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        for line in score_rows(cfg, rows, window.first):
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
