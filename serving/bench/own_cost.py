"""The gateway's own code per ``Score`` call, in process: ``python -m serving.bench.own_cost``.

Runs the handler exactly as the gateway registers it (the metrics and admission chain,
``Ranker.Score``: decode, validate, admission, coalescer, backend pool, hedge timer, envelope,
response) on the export's sample rows, with a stand-in for the two things that are not ours:
grpc's server context and the TorchServe call (it answers at once with as many scores as
examples). Prints the CPU time per call (best of ``--rounds``), so a change to the scoring path
can be weighed in a second, without TorchServe, grpc or a loaded machine's noise; the serving
bench (``python -m serving.bench``) is what says what it is worth end to end. The figure is a
hot loop's: in the server, with its caches cold between requests, the same code costs 2-3x.

Usage: ``python -m serving.bench.own_cost --export runs/demo/export --sizes '[1,100,1000]'``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np

from recsys_stack.config import ConfigError, parse
from serving.bench.model import Model, payload
from serving.gateway import metrics
from serving.gateway.admission import AdmissionInterceptor
from serving.gateway.backends import BackendPool
from serving.gateway.config import GatewayConfig
from serving.gateway.plan_watcher import schema_plan
from serving.gateway.ranker import SERVICE, Ranker
from serving.gateway.rpc import Chain, Routes, add_servicer
from serving.gateway.validate import Schema
from serving.stubs import ranker_pb2_grpc
from serving.worker.codec import encode_response

KEYS = '{"inference": {"key": "k"}, "management": {"key": "k"}, "API": {"key": "k"}}'


@dataclass
class OwnCostConfig:
    """The gateway's own code per Score call, in process (see the module doc)."""

    export: Path = Path("runs/demo/export")
    """An export folder (schema.json and sample.npz)."""
    sizes: list[int] = field(default_factory=lambda: [1, 100, 1000])
    """Examples per request."""
    calls: int = 1000
    """Calls per round (a tenth of them for 1,000 examples and more)."""
    rounds: int = 7
    """Rounds; the best is printed (the least disturbed by the rest of the machine)."""


class _Details(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


class _Context:
    """What ``Score`` asks of grpc's server context."""

    def __init__(self, request: bytes) -> None:
        self.request = request

    def time_remaining(self) -> float:
        return 10.0

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()  # no token: the gateway's tenant "default", as without a token file

    async def read(self) -> bytes:
        return self.request

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")

    def code(self) -> None:
        return None

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass


async def measure(cfg: OwnCostConfig, key_file: Path) -> dict[int, float]:
    """Microseconds of CPU per call, per request size."""
    model = Model.load(cfg.export)
    schema = Schema.load(cfg.export / "schema.json")
    gw = GatewayConfig(
        backend="127.0.0.1:1", key_file=str(key_file), schema=cfg.export / "schema.json"
    )
    m = metrics.configure(gw.limits.max_examples, gw.coalesce.max_examples)
    pool = BackendPool(gw.backend, gw.key_file, schema.model_name, gw.deadline_s, hedge=gw.hedge)
    ranker = Ranker(gw, schema, pool, schema_plan(schema))
    ranker.set_plan(ranker.plan)
    loop = asyncio.get_running_loop()
    answer = [b""]

    def predictions(request: bytes, metadata: Any = None, timeout: float | None = None) -> Any:
        done = loop.create_future()  # what grpc's call object is to the pool: awaitable, done
        done.set_result(answer[0])
        return done

    for b in pool.backends:
        b.ready[ranker.plan.default] = True
        b.predictions = predictions
    for _ in range(32):  # a learned tail: the hedge timer's path, as under load
        pool.hedger.observe(0.003)
    method = f"/{SERVICE}/Score"  # looked up as the gateway's server does (no auth configured)
    routes = Routes(
        Chain(metrics.MetricsInterceptor(m), AdmissionInterceptor(ranker.admission, (method,)))
    )
    add_servicer(routes, ranker_pb2_grpc.add_RankerServicer_to_server, ranker, raw=("Score",))
    handler = routes.service(_Details(method, ()))
    if handler is None:
        raise RuntimeError(f"{method} is not registered")
    call = handler.stream_unary or handler.unary_unary
    out: dict[int, float] = {}
    try:
        for n in cfg.sizes:
            request = payload(model, n).score.SerializeToString()
            answer[0] = encode_response(np.full(n, 0.5, np.float32))  # the prediction, sliced
            context = _Context(request)
            k = max(10, cfg.calls // 10 if n >= 1000 else cfg.calls)
            for _ in range(k // 10):  # warm
                await call(None, context)
            best = float("inf")
            for _ in range(cfg.rounds):
                t0 = time.thread_time()
                for _ in range(k):
                    await call(None, context)
                best = min(best, (time.thread_time() - t0) / k)
            out[n] = best * 1e6
    finally:
        await pool.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse(OwnCostConfig, argv, "python -m serving.bench.own_cost", __doc__ or "")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (cfg.export / "schema.json").is_file() or not (cfg.export / "sample.npz").is_file():
        print(
            f"error: {cfg.export} has no schema.json and sample.npz: give --export", file=sys.stderr
        )
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "key_file.json"
        keys.write_text(KEYS)
        got = asyncio.run(measure(cfg, keys))
    for n, us in got.items():
        print(f"{n:>6} examples: {us:7.1f} us of CPU per Score call (the gateway's own code)")
    print(json.dumps({"us_per_call": {str(n): round(us, 1) for n, us in got.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
