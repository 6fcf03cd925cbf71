"""The least a gRPC hop in front of TorchServe can cost: ``python -m serving.bench.relay``.

A ``grpc.aio`` server, like the gateway's, that forwards TorchServe's ``Predictions`` as raw
bytes (no decode, no validation, no merging, no metrics) to one TorchServe with the caller's
metadata, and returns the reply's bytes. The benchmark's ``relay`` method (one of the
defaults) calls it with the ``torchserve-grpc`` request: the difference between the two is the
price of the hop alone, the floor under anything the gateway does.

Usage: ``python -m serving.bench.relay PORT BACKEND`` (prints ``ready`` when listening).
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc

from serving.torchserve.client import PREDICTIONS


async def relay(port: int, backend: str, max_bytes: int = 64 << 20) -> None:
    size = [("grpc.max_send_message_length", max_bytes),
            ("grpc.max_receive_message_length", max_bytes)]  # fmt: skip
    channel = grpc.aio.insecure_channel(backend, options=size)
    forward = channel.unary_unary(PREDICTIONS, request_serializer=None, response_deserializer=None)

    async def predictions(request: bytes, context: grpc.aio.ServicerContext) -> Any:
        metadata = [(k, v) for k, v in context.invocation_metadata() or () if k[0] != ":"]
        try:
            return await forward(request, metadata=metadata, timeout=context.time_remaining())
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")

    handler = grpc.unary_unary_rpc_method_handler(predictions)
    service, method = PREDICTIONS.rsplit("/", 1)
    server = grpc.aio.server(options=size)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.lstrip("/"), {method: handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.split("\n\n")[-1], file=sys.stderr)
        return 2
    asyncio.run(relay(int(sys.argv[1]), sys.argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
