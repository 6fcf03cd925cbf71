"""One lite worker: ``python -m serving.lite.worker DIR --port P --key-file F``.

Loads the unpacked ``.mar`` in ``DIR`` with the stack's own handler (serving/worker/handler.py:
the same variant choice, intra-op threads, decode, merge, forward, refusals, describe answer and
embedding deltas as in a TorchServe worker) and serves TorchServe's gRPC inference API
(``InferenceAPIsService/Predictions`` and ``Ping``) on ``host:port``, so the gateway calls it
as it calls a TorchServe replica. What it leaves out is TorchServe's per-call cost: the Java
frontend, its queue and the socket hop to a Python worker (docs/bench.md).

- Calls run one at a time on the event loop: the worker's one job, as a TorchServe worker runs
  one batch at a time; the next waits in gRPC's queue. The describe answer says ``workers``: 1,
  so the gateway gives each worker one call in flight (``coalesce.calls_per_worker``).
- Auth as TorchServe's: a random inference key, written at start to ``--key-file``
  (``{"inference": {"key": ...}}``, mode 0600; TorchServe writes new keys at every start too),
  is required as ``authorization: Bearer <key>``; anything else is PERMISSION_DENIED.
- A request for another model or version is NOT_FOUND (TorchServe's answer for an unknown one).
- ``--socket PATH``: the same calls on a Unix socket, in the frames of serving/lite/frames.py
  (the gateway's ``lite:PATH`` backends: no gRPC stack on either side), the socket 0600 in a
  0700 folder, the same key as the first frame of each connection.
- SIGTERM: stop taking calls, finish those running (up to 10 s), exit 0.

Prints ``ready <port>`` on stdout once loaded, warmed up and listening.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from serving.lite.frames import REPLY, REQUEST, FrameTooLarge, check_path, cut
from serving.torchserve.client import PREDICTIONS, field_head, inference_pb2

logger = logging.getLogger("serving.lite.worker")
SERVICE = PREDICTIONS.rsplit("/", 2)[1]
MAX_MESSAGE = 256 << 20  # TorchServe's gRPC limit is set per stack; the gateway bounds requests
GRACE_S = 10.0
DENIED = b"Token Authorization failed"
REFUSED_LINGER_S = 1.0  # a socket client with a wrong key is disconnected this long after


class Context:
    """What the handler reads of TorchServe's context: the model's folder, the manifest, the
    GPU (None: CPU), and where a refused request's status goes (gRPC drops it, as TorchServe's
    gRPC API does: the refusal travels in the prediction)."""

    def __init__(self, model_dir: Path, manifest: dict[str, Any], gpu_id: int | None) -> None:
        self.system_properties = {"model_dir": str(model_dir), "gpu_id": gpu_id}
        self.manifest = manifest
        self.statuses: dict[int, tuple[int, str]] = {}

    def set_response_status(self, code: int, phrase: str, idx: int = 0) -> None:
        self.statuses[idx] = (code, phrase)


def write_key(path: Path) -> str:
    """A new inference key, written to ``path`` as TorchServe's key file (0600, atomic)."""
    key = secrets.token_urlsafe(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"inference": {"key": key}}, f)
    tmp.replace(path)
    return key


def load_handler(model_dir: Path, gpu_id: int | None) -> tuple[Any, Context]:
    """The stack's handler, initialized on the unpacked ``.mar`` in ``model_dir``."""
    from serving.worker.handler import RecsysHandler

    manifest = json.loads((model_dir / "MAR-INF" / "MANIFEST.json").read_text())
    context = Context(model_dir, manifest, gpu_id)
    handler = RecsysHandler()
    handler.initialize(context)
    return handler, context


class Worker:
    """The gRPC methods over one initialized handler."""

    def __init__(self, handler: Any, context: Context, key: str) -> None:
        self.handler, self.context = handler, context
        model = context.manifest["model"]
        self.name, self.version = model["modelName"], model["modelVersion"]
        self.bearer = f"Bearer {key}".encode()

    def _authorized(self, context: grpc.aio.ServicerContext) -> bool:
        for k, v in context.invocation_metadata() or ():
            if k == "authorization":
                given = v.encode() if isinstance(v, str) else v
                return hmac.compare_digest(given, self.bearer)
        return False

    def answer(self, raw: bytes) -> tuple[grpc.StatusCode, bytes]:
        """A serialized ``PredictionsRequest`` -> (status, the prediction's bytes or the
        refusal's details): what both doors (gRPC, the socket) answer."""
        try:
            request = inference_pb2.PredictionsRequest.FromString(raw)
        except DecodeError as e:
            return grpc.StatusCode.INVALID_ARGUMENT, f"not a PredictionsRequest: {e}".encode()
        if request.model_name != self.name or request.model_version not in ("", self.version):
            return grpc.StatusCode.NOT_FOUND, (
                f"Model not found: {request.model_name} {request.model_version or '(default)'} "
                f"(this worker serves {self.name} {self.version})"
            ).encode()
        self.context.statuses.clear()
        try:
            out = self.handler.handle([dict(request.input)], self.context)[0]
        except Exception as e:  # the handler refuses bad bodies itself: this is a fault
            logger.exception("the handler failed")
            return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}".encode()
        if not isinstance(out, bytes | bytearray):  # a JSON request's scores: a list
            out = json.dumps(out).encode()
        return grpc.StatusCode.OK, bytes(out)

    async def predictions(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if not self._authorized(context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, DENIED.decode())
        code, out = self.answer(raw)
        if code != grpc.StatusCode.OK:
            await context.abort(code, out.decode())
        return field_head(0x0A, len(out)) + out  # PredictionResponse.prediction (field 1)

    async def ping(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        health = json.dumps({"status": "Healthy"}).encode()
        return field_head(0x0A, len(health)) + health  # TorchServeHealthResponse.health


class SocketDoor(asyncio.Protocol):
    """One connection to the worker's Unix socket (serving/lite/frames.py): a hello frame with
    the key, then requests answered in order, each scored as it is read (one at a time, on
    the event loop, as gRPC's calls are)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.buf = bytearray()
        self.hello = False
        self.refused = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None:
            try:
                frame = cut(self.buf, REQUEST)
            except FrameTooLarge as e:
                self._end(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
                return
            if frame is None:
                return
            (_, deadline), payload = frame
            if not self.hello:
                self.hello = True
                if not hmac.compare_digest(payload, self.worker.bearer):
                    # the refusal answers the client's first request; what it already sent
                    # is refused too (closing with it unread would lose the answer), then
                    # the connection ends
                    self.refused = True
                    self._reply(grpc.StatusCode.PERMISSION_DENIED, DENIED)
                    asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self.transport.close)
            elif self.refused:
                self._reply(grpc.StatusCode.PERMISSION_DENIED, DENIED)
            elif deadline and time.time() > deadline:
                self._reply(grpc.StatusCode.DEADLINE_EXCEEDED, b"its deadline passed in the queue")
            else:
                self._reply(*self.worker.answer(payload))

    def _reply(self, code: grpc.StatusCode, out: bytes) -> None:
        assert self.transport is not None
        self.transport.writelines((REPLY.pack(len(out), code.value[0]), out))

    def _end(self, code: grpc.StatusCode, why: str) -> None:
        assert self.transport is not None
        self._reply(code, why.encode())
        self.transport.close()
        self.transport = None


async def serve(worker: Worker, host: str, port: int, sock: Path | None = None) -> None:
    size = [("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE)]  # fmt: skip
    server = grpc.aio.server(options=size)
    methods = {
        "Predictions": grpc.unary_unary_rpc_method_handler(worker.predictions),
        "Ping": grpc.unary_unary_rpc_method_handler(worker.ping),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot listen on {host}:{port}: is the port taken?")
    loop = asyncio.get_running_loop()
    door = None
    if sock is not None:  # only this user may connect: the folder 0700, the socket 0600
        sock.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        sock.unlink(missing_ok=True)  # a previous worker's
        door = await loop.create_unix_server(lambda: SocketDoor(worker), str(sock))
        sock.chmod(0o600)
    await server.start()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    print(f"ready {port}", flush=True)
    await stopping.wait()
    if door is not None:
        door.close()  # no new connections; calls already read are answered
    await server.stop(GRACE_S)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serving.lite.worker",
        description="One lite worker: an unpacked .mar behind TorchServe's gRPC inference API "
        "(started by python -m serving.lite, which unpacks the .mar and runs the workers).",
    )
    p.add_argument("model_dir", type=Path, help="the unpacked .mar (MAR-INF/MANIFEST.json in it)")
    p.add_argument("--port", type=int, required=True, help="gRPC port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    p.add_argument("--key-file", type=Path, required=True, help="where the inference key goes")
    p.add_argument("--socket", type=Path, default=None,
                   help="also serve the gateway's frames on this Unix socket "
                   "(serving/lite/frames.py)")  # fmt: skip
    p.add_argument("--gpu", type=int, default=None, help="CUDA device (default: CPU)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s lite %(message)s")
    if not (args.model_dir / "MAR-INF" / "MANIFEST.json").is_file():
        print(f"error: {args.model_dir} is not an unpacked .mar (no MAR-INF/MANIFEST.json): "
              "start workers with python -m serving.lite MAR", file=sys.stderr)  # fmt: skip
        return 2
    try:
        args.socket is None or check_path(str(args.socket))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("RECSYS_REPLICA_WORKERS", "1")  # its describe answer: one worker
    handler, context = load_handler(args.model_dir, args.gpu)
    worker = Worker(handler, context, write_key(args.key_file))
    try:
        asyncio.run(serve(worker, args.host, args.port, args.socket))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
