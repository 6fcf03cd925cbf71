"""``python -m loadtest.calibrate``: the load generator's own ceiling, against a no-op server.

Starts an in-process ``recsys.v1.Ranker`` server on a free loopback port that returns fixed
scores (no validation, no model) and runs the same Locust load as ``loadtest.run`` against it.
Its throughput is about the most the generator can send with these settings; a real run far
below it (< 0.5x) is limited by the server, one near it by the generator (add ``--processes``).
The no-op server shares the machine's cores with the generator, so on small machines the figure
is a lower bound. Writes ``calibration.json`` (and Locust's files) into ``--out``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from loadtest.config import ROOT, SHORT_FLAGS, LoadConfig, resolve_data
from loadtest.locust_runner import run_locust
from recsys_stack import config as rc
from recsys_stack.net import free_ports
from serving.stubs import ranker_pb2, ranker_pb2_grpc
from serving.tools.channel import plaintext_env


class NoopRanker(ranker_pb2_grpc.RankerServicer):  # type: ignore[misc]
    """Scores every example 0.5: what is left is gRPC, protobuf and the generator."""

    def Score(self, request: Any, context: Any) -> Any:  # the gRPC method's name
        return ranker_pb2.ScoreResponse(
            scores=[0.5] * request.num_examples, model_name="noop", model_version="0"
        )


def start_noop(port: int, threads: int = 16) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads))
    ranker_pb2_grpc.add_RankerServicer_to_server(NoopRanker(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


def ceiling_run(cfg: LoadConfig, out: Path) -> dict[str, Any]:
    """``cfg``'s load (users, duration, examples, processes) against a no-op server -> summary."""
    port = free_ports(1)[0]
    server = start_noop(port)
    try:
        # the no-op server is plaintext, whatever RECSYS_CLIENT_TLS_* say for the gateway
        s = run_locust(cfg, f"127.0.0.1:{port}", cfg.users, cfg.duration, out, cfg.spawn_rate,
                       env=plaintext_env())  # fmt: skip
    finally:
        server.stop(grace=1).wait()
    doc = {**s, "users": cfg.users, "processes": cfg.processes,
           "examples_per_request": cfg.examples, "duration": cfg.duration}  # fmt: skip
    (out / "calibration.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        parser = rc.ArgumentParser(
            prog="python -m loadtest.calibrate", description=__doc__.split("\n\n")[0]
        )
        ns = rc.add_config_args(parser, LoadConfig, short=SHORT_FLAGS).parse_args(argv)
        cfg = rc.from_args(LoadConfig, ns)
        cfg.check()
        resolve_data(cfg)
    except rc.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = cfg.out or ROOT / "reports" / time.strftime("calibration-%Y%m%d-%H%M%S")
    try:
        s = ceiling_run(cfg, out)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"generator ceiling: {s['rps']:.1f} rps, p50 {s['p50_ms']:g} ms, p99 {s['p99_ms']:g} ms "
        f"({cfg.users} users, {cfg.processes} process(es), {cfg.examples} ex/req; {out})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
