"""``make serve`` / ``make stop``: TorchServe and the gateway in the background, health-checked.

``python -m serving.stack start --schema runs/demo/export/schema.json`` starts TorchServe with
the model store's archive of that model version, then the gateway, and returns once the
gateway's health service says SERVING (or fails with the log tail). ``stop`` ends both (the
gateway first, gracefully). State (pid files, logs, TorchServe's key file) lives in
``--workdir`` (default runs/serve).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving import torchserve as ts
from serving.validate import Schema

GATEWAY_PID = "gateway.pid"
GATEWAY_LOG = "gateway.log"


def gateway_status(target: str, timeout: float = 1.0) -> str:
    """SERVING / NOT_SERVING / UNREACHABLE of the gateway's grpc.health.v1 service."""
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError:
        return "UNREACHABLE"


def start_gateway(
    schema: Path, cfg: ts.TorchServeConfig, port: int, workdir: Path
) -> subprocess.Popen[bytes]:
    log = open(workdir / GATEWAY_LOG, "ab")  # noqa: SIM115  the child owns it
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "serving.gateway", "--schema", str(schema), "--port", str(port),
             "--backend", cfg.grpc_inference_target, "--key-file", str(cfg.key_file.resolve())],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    finally:
        log.close()


def wait_serving(target: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with code {proc.returncode}")
        if gateway_status(target) == "SERVING":
            return
        time.sleep(0.5)
    raise RuntimeError(f"the gateway at {target} was not SERVING after {timeout:.0f}s")


def _pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def stop_all(workdir: Path) -> None:
    gw = _pid(workdir / GATEWAY_PID)
    if gw is not None:
        os.kill(gw, signal.SIGTERM)  # graceful: in-flight calls finish
        for _ in range(100):
            if _pid(workdir / GATEWAY_PID) is None:
                break
            time.sleep(0.1)
        else:
            os.killpg(gw, signal.SIGKILL)
    (workdir / GATEWAY_PID).unlink(missing_ok=True)
    tsp = _pid(workdir / ts.PID_FILE)
    if tsp is not None:
        ts.stop(tsp)
    (workdir / ts.PID_FILE).unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m serving.stack", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("command", choices=["start", "stop", "status"])
    p.add_argument("--schema", type=Path, default=Path("runs/demo/export/schema.json"))
    p.add_argument("--model-store", type=Path, default=Path("model_store"))
    p.add_argument(
        "--workdir", type=Path, default=Path(os.environ.get("RECSYS_SERVE_DIR", "runs/serve"))
    )
    p.add_argument("--port", type=int, default=int(os.environ.get("RECSYS_GATEWAY_PORT", "50051")))
    p.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for SERVING")
    ns = p.parse_args(argv)
    target = f"127.0.0.1:{ns.port}"
    if ns.command == "stop":
        stop_all(ns.workdir)
        print("stopped")
        return 0
    if ns.command == "status":
        print(f"gateway {target}: {gateway_status(target)}")
        return 0
    try:
        schema = Schema.load(ns.schema)
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {ns.schema}: {e} (run `make export` first)", file=sys.stderr)
        return 2
    if _pid(ns.workdir / GATEWAY_PID) or _pid(ns.workdir / ts.PID_FILE):
        print(f"error: already running ({ns.workdir}); `make stop` first", file=sys.stderr)
        return 2
    cfg = ts.TorchServeConfig(
        workdir=ns.workdir,
        model_store=ns.model_store,
        model_name=schema.model_name,
        model_version=schema.model_version,
    )
    ns.workdir.mkdir(parents=True, exist_ok=True)
    try:
        proc = ts.start(cfg)
        (ns.workdir / ts.PID_FILE).write_text(f"{proc.pid}\n")
        ts.wait_ready(cfg, timeout=ns.timeout, proc=proc)
        gw = start_gateway(ns.schema, cfg, ns.port, ns.workdir)
        (ns.workdir / GATEWAY_PID).write_text(f"{gw.pid}\n")
        wait_serving(target, gw, ns.timeout)
    except (FileNotFoundError, RuntimeError, ValueError, TimeoutError) as e:
        print(f"error: {e}\n(logs: {ns.workdir})", file=sys.stderr)
        stop_all(ns.workdir)
        return 1
    print(
        f"serving {schema.model_name} v{schema.model_version}: gateway {target}, TorchServe gRPC {cfg.grpc_inference_target}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
