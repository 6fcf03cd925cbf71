"""gRPC gateway: ``recsys.v1.Ranker/Score`` -> validate -> TorchServe gRPC ``Predictions``.

``python -m serving.gateway --schema runs/demo/export/schema.json`` (see ``--help``). A
``grpc.aio`` server with the standard health service (NOT_SERVING until TorchServe reports the
model ready, polled in the background) and server reflection (grpcurl works without protos).
Errors carry honest codes: INVALID_ARGUMENT for a bad request (the message names the field and
example), UNAVAILABLE when TorchServe or its workers are down, DEADLINE_EXCEEDED when it is too
slow, INTERNAL only for what can only be a bug.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.backends import BackendError, BackendPool, read_inference_key
from serving.codec import CodecError, decode_response, encode_request
from serving.protos import ensure_generated
from serving.validate import InvalidRequest, Limits, Schema, validate

ensure_generated()
from serving._gen.recsys.v1 import ranker_pb2, ranker_pb2_grpc  # noqa: E402

logger = logging.getLogger("serving.gateway")
SERVICE = "recsys.v1.Ranker"


@dataclass
class GatewayConfig:
    schema: Path = Path("runs/demo/export/schema.json")
    """The exported model's schema.json (feature names and order, model name and version)."""
    port: int = int(os.environ.get("RECSYS_GATEWAY_PORT", "50051"))
    """Gateway port (env RECSYS_GATEWAY_PORT)."""
    host: str = os.environ.get("RECSYS_GATEWAY_HOST", "127.0.0.1")
    """Bind address (env RECSYS_GATEWAY_HOST)."""
    backend: str = os.environ.get("RECSYS_TS_GRPC", "127.0.0.1:7070")
    """TorchServe gRPC inference address(es), comma-separated: round robin over the healthy
    ones, failover on an outage (env RECSYS_TS_GRPC)."""
    key_file: str = os.environ.get("RECSYS_TS_KEY_FILE", "runs/serve/key_file.json")
    """TorchServe key_file.json path(s): one for all backends or one per backend,
    comma-separated; the inference key goes in the call metadata (env RECSYS_TS_KEY_FILE)."""
    deadline_s: float = 2.0
    """Deadline of each call to TorchServe."""
    limits: Limits = field(default_factory=Limits)
    health_interval_s: float = 1.0
    """How often TorchServe's readiness is polled for the health service."""
    grace_s: float = 5.0
    """On SIGTERM: how long in-flight calls may finish."""

    def key_files(self) -> list[Path]:
        return [Path(p.strip()) for p in self.key_file.split(",") if p.strip()]


class Ranker(ranker_pb2_grpc.RankerServicer):  # type: ignore[misc]
    def __init__(self, cfg: GatewayConfig, schema: Schema, pool: BackendPool) -> None:
        self.cfg = cfg
        self.schema = schema
        self.pool = pool

    async def Score(
        self, request: ranker_pb2.ScoreRequest, context: grpc.aio.ServicerContext
    ) -> ranker_pb2.ScoreResponse:
        try:
            dense, values, lengths = validate(
                request, self.schema, self.cfg.limits, request.ByteSize()
            )
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        version = request.model_version or self.schema.model_version
        if version != self.schema.model_version:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"model_version '{version}' is not served here (this gateway serves "
                f"{self.schema.model_name} v{self.schema.model_version})",
            )
        body = encode_request(
            torch.from_numpy(dense), torch.from_numpy(values), torch.from_numpy(lengths)
        )
        try:
            prediction, backend = await self.pool.predict(body, version, context.time_remaining())
        except BackendError as e:
            await context.abort(e.code, e.message)
        await context.send_initial_metadata((("x-recsys-backend", backend),))
        try:
            scores = decode_response(prediction)
        except CodecError as e:  # includes the handler refusing a request we validated: a bug
            await context.abort(
                grpc.StatusCode.INTERNAL, f"TorchServe's reply does not decode: {e}"
            )
        if scores.numel() != dense.shape[0]:
            await context.abort(
                grpc.StatusCode.INTERNAL,
                f"TorchServe returned {scores.numel()} scores for {dense.shape[0]} examples",
            )
        return ranker_pb2.ScoreResponse(
            scores=np.asarray(scores, dtype=np.float32).tolist(),
            model_name=self.schema.model_name,
            model_version=version,
        )


async def poll_health(
    cfg: GatewayConfig, schema: Schema, pool: BackendPool, servicer: health.aio.HealthServicer
) -> None:
    """SERVING while at least one backend answers a probe request; NOT_SERVING otherwise."""
    status = None
    while True:
        ok = await pool.refresh(schema.model_version, len(schema.dense), len(schema.sparse))
        new = (
            health_pb2.HealthCheckResponse.SERVING
            if ok
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if new != status:
            logger.info("gateway is %s", health_pb2.HealthCheckResponse.ServingStatus.Name(new))
            status = new
            for name in ("", SERVICE):
                await servicer.set(name, new)
        await asyncio.sleep(cfg.health_interval_s)


async def serve(cfg: GatewayConfig, ready: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT; then stop accepting and let in-flight calls finish."""
    schema = Schema.load(cfg.schema)
    options = [
        ("grpc.max_receive_message_length", 2 * cfg.limits.max_request_bytes),
        ("grpc.max_send_message_length", 2 * cfg.limits.max_request_bytes),
    ]
    pool = BackendPool(
        [t.strip() for t in cfg.backend.split(",") if t.strip()],
        cfg.key_files(),
        schema.model_name,
        cfg.deadline_s,
        options,
    )
    server = grpc.aio.server(options=options)
    ranker_pb2_grpc.add_RankerServicer_to_server(Ranker(cfg, schema, pool), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    await server.start()
    logger.info(
        "gateway on %s:%d -> TorchServe %s, model %s v%s",
        cfg.host,
        port,
        cfg.backend,
        schema.model_name,
        schema.model_version,
    )
    poller = asyncio.create_task(poll_health(cfg, schema, pool, health_servicer))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    logger.info("stopping: %.1fs grace for in-flight calls", cfg.grace_s)
    poller.cancel()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(cfg.grace_s)
    await pool.close()


def parse_args(argv: Sequence[str] | None = None) -> GatewayConfig:
    d = GatewayConfig()
    p = argparse.ArgumentParser(
        prog="python -m serving.gateway", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--schema",
        type=Path,
        default=d.schema,
        help=f"schema.json of the served model (default {d.schema})",
    )
    p.add_argument("--host", default=d.host, help="bind address (env RECSYS_GATEWAY_HOST)")
    p.add_argument(
        "--port", type=int, default=d.port, help="port (env RECSYS_GATEWAY_PORT, default 50051)"
    )
    p.add_argument(
        "--backend",
        default=d.backend,
        help="TorchServe gRPC inference host:port[,host:port...]: round robin over the healthy "
        "ones (env RECSYS_TS_GRPC)",
    )
    p.add_argument(
        "--key-file",
        default=d.key_file,
        help="TorchServe key_file.json, or one per backend, comma-separated (env RECSYS_TS_KEY_FILE)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=d.deadline_s,
        help="seconds per TorchServe call (default 2)",
    )
    p.add_argument("--max-examples", type=int, default=d.limits.max_examples)
    p.add_argument("--max-ids-per-feature", type=int, default=d.limits.max_ids_per_feature)
    p.add_argument("--max-request-bytes", type=int, default=d.limits.max_request_bytes)
    ns = p.parse_args(argv)
    return GatewayConfig(
        schema=ns.schema, port=ns.port, host=ns.host, backend=ns.backend, key_file=ns.key_file,
        deadline_s=ns.deadline,
        limits=Limits(ns.max_examples, ns.max_ids_per_feature, ns.max_request_bytes),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = parse_args(argv)
    try:
        Schema.load(cfg.schema)
        backends = [t for t in cfg.backend.split(",") if t.strip()]
        if len(cfg.key_files()) not in (1, len(backends)):
            raise ValueError(f"{len(cfg.key_files())} key files for {len(backends)} backends")
        for path in cfg.key_files():
            read_inference_key(path)
    except (OSError, KeyError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    asyncio.run(serve(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
