"""The floor under issue 11's refusal bound: ``python -m serving.bench.burst``.

64 callers (4 processes x 16 threads, one connection each) send the largest request's size
(1.7 MB) at the same moment, backing off after each refusal, against a ``grpc.aio`` server
whose handler does nothing but refuse at once (stream-unary, before reading the request: the
gateway's door without the gateway). The refusal times it prints are what any ``grpc.aio``
server pays on this machine for such a burst, with no model, no TorchServe and no decoding
running beside it; compare them with tests/serving/test_overload.py's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np

from recsys_stack.net import free_ports

METHOD = "/bench.Burst/Refuse"
OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]


def serve(port: int) -> None:
    async def refuse(requests: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded")

    async def main() -> None:
        server = grpc.aio.server(options=OPTIONS)
        handler = grpc.stream_unary_rpc_method_handler(refuse)
        service, method = METHOD.strip("/").split("/")
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def callers(
    port: int, n: int, size: int, seconds: float, start_at: float
) -> list[tuple[float, float]]:
    """``n`` threads calling from ``start_at`` (monotonic) for ``seconds``: (start, seconds)."""
    body = b"\x00" * size
    out: list[tuple[float, float]] = []
    lock = threading.Lock()

    def caller() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            call = channel.unary_unary(METHOD)
            time.sleep(max(0.0, start_at - time.monotonic()))
            backoff = 0.05
            while True:  # one call at least: a caller late for the window still measures one
                t0 = time.monotonic()
                with contextlib.suppress(grpc.RpcError):  # RESOURCE_EXHAUSTED, as designed
                    call(body, timeout=10)
                with lock:
                    out.append((t0 - start_at, time.monotonic() - t0))
                if time.monotonic() >= start_at + seconds:
                    break
                time.sleep(backoff)
                backoff = min(1.0, 2 * backoff)

    threads = [threading.Thread(target=caller) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.burst", description=__doc__)
    ap.add_argument("--callers", type=int, default=64, help="simultaneous callers (64)")
    ap.add_argument("--processes", type=int, default=4, help="client processes (4)")
    ap.add_argument("--bytes", type=int, default=1_700_000, help="request size (1.7 MB)")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long they call (8)")
    args = ap.parse_args(argv)
    port = free_ports(1)[0]
    ctx = multiprocessing.get_context("spawn")
    server = ctx.Process(target=serve, args=(port,), daemon=True)
    server.start()
    try:
        start_at = time.monotonic() + 3.0  # every caller connected before it
        each = args.callers // args.processes
        with ctx.Pool(args.processes) as pool:
            parts = pool.starmap(
                callers, [(port, each, args.bytes, args.seconds, start_at)] * args.processes
            )
    finally:
        server.kill()
    calls = [c for part in parts for c in part]
    ms = np.array([s for _, s in calls]) * 1e3
    first = np.array([s for t, s in calls if t < 1.0]) * 1e3
    print(
        f"{len(calls)} refusals by a server that only refuses: p50 {np.median(ms):.1f} / p99 "
        f"{np.percentile(ms, 99):.1f} / max {ms.max():.1f} ms; {(ms > 50).sum()} over 50 ms; "
        f"first second: {first.size} calls"
        + (
            f", max {first.max():.1f} ms"
            if first.size
            else " (the callers started late: busy machine)"
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
