"""Run TorchServe for one model archive: config file, start, readiness, keys, stop, gRPC scoring.

``python -m serving.torchserve start|stop|status`` (see ``--help``); ``make serve`` wraps it.
Everything TorchServe writes goes to one work directory: ``config.properties``, the token
``key_file.json`` (TorchServe writes it into its working directory), ``logs/``, its pid file
and its worker sockets (``tmp/``, so two instances on one machine never collide).

TorchServe 0.12 defaults kept on purpose: token authorization ON (every call carries
``authorization: Bearer <key>``), model API OFF (the model is registered at startup from
``config.properties``, nobody can load another archive at runtime).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil  # a TorchServe dependency

logger = logging.getLogger(__name__)

# The one place that names the port variables (the gateway and compose files read these too).
PORT_ENV = {
    "inference_port": "RECSYS_TS_INFERENCE_PORT",
    "management_port": "RECSYS_TS_MANAGEMENT_PORT",
    "metrics_port": "RECSYS_TS_METRICS_PORT",
    "grpc_inference_port": "RECSYS_TS_GRPC_INFERENCE_PORT",
    "grpc_management_port": "RECSYS_TS_GRPC_MANAGEMENT_PORT",
}
WORKDIR_ENV = "RECSYS_TS_WORKDIR"
PID_FILE = "torchserve.pid"
LOG_FILE = "torchserve.log"


def _env_port(name: str, default: int) -> Any:
    """A dataclass default read from ``PORT_ENV[name]`` when the instance is created."""

    def read() -> int:
        raw = os.environ.get(PORT_ENV[name], "")
        if not raw:
            return default
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise ValueError(f"{PORT_ENV[name]}={raw!r} is not a port number (1-65535)")
        return int(raw)

    return field(default_factory=read)


@dataclass
class TorchServeConfig:
    """One TorchServe instance serving one model version."""

    inference_port: int = _env_port("inference_port", 8080)
    """REST inference API (env RECSYS_TS_INFERENCE_PORT)."""
    management_port: int = _env_port("management_port", 8081)
    """REST management API: describe, scale (env RECSYS_TS_MANAGEMENT_PORT)."""
    metrics_port: int = _env_port("metrics_port", 8082)
    """Prometheus metrics, ``GET /metrics`` (env RECSYS_TS_METRICS_PORT)."""
    grpc_inference_port: int = _env_port("grpc_inference_port", 7070)
    """gRPC ``InferenceAPIsService``: what the gateway calls (env RECSYS_TS_GRPC_INFERENCE_PORT)."""
    grpc_management_port: int = _env_port("grpc_management_port", 7071)
    """gRPC ``ManagementAPIsService`` (env RECSYS_TS_GRPC_MANAGEMENT_PORT)."""
    host: str = "127.0.0.1"
    """Bind address of every API; the gateway is the public face, TorchServe stays local."""
    model_store: Path = Path("model_store")
    """Folder holding the .mar files (TorchServe's ``--model-store``)."""
    mar_file: str = ""
    """Archive in ``model_store`` to serve; empty = ``<model_name>-<model_version>.mar``."""
    model_name: str = "dlrm-demo"
    """Name the model is served under (gRPC ``model_name``, URL path)."""
    model_version: str = "1.0"
    """Version registered (and made the default) for ``model_name``."""
    workers: int = 1
    """Worker processes for the model (min = max: no autoscaling surprises)."""
    batch_size: int = 8
    """Most requests TorchServe aggregates into one ``handle`` call."""
    max_batch_delay_ms: int = 5
    """How long TorchServe waits to fill a batch before sending what it has."""
    response_timeout_s: int = 120
    """A worker that takes longer on a batch is considered stuck and restarted."""
    startup_timeout_s: int = 120
    """Longest a worker may take to load the model."""
    job_queue_size: int = 1000
    """Requests queued per model before TorchServe answers 503 (its default is 100)."""
    max_request_bytes: int = 16 * 1024 * 1024
    """Largest request body (REST and gRPC); TorchServe's 6.5 MB default is ~25k examples."""
    token_expiration_min: float = 60 * 24 * 365
    """Lifetime of the keys in key_file.json; TorchServe's default (60 min) would lock out a
    gateway that read the key once, so a long-lived instance gets a long-lived key."""
    workdir: Path = field(
        default_factory=lambda: Path(os.environ.get(WORKDIR_ENV, "runs/torchserve"))
    )
    """config.properties, key_file.json, logs, pid file, worker sockets (env RECSYS_TS_WORKDIR)."""

    @property
    def mar(self) -> str:
        return self.mar_file or f"{self.model_name}-{self.model_version}.mar"

    @property
    def key_file(self) -> Path:
        return self.workdir / "key_file.json"

    @property
    def log_file(self) -> Path:
        return self.workdir / LOG_FILE

    @property
    def grpc_inference_target(self) -> str:
        return f"{self.host}:{self.grpc_inference_port}"


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (held together while chosen)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def model_from_mar(mar: Path) -> tuple[str, str]:
    """``(modelName, modelVersion)`` from the archive's manifest."""
    with zipfile.ZipFile(mar) as z:
        model = json.loads(z.read("MAR-INF/MANIFEST.json"))["model"]
    return model["modelName"], model["modelVersion"]


def write_properties(cfg: TorchServeConfig) -> Path:
    """Write ``<workdir>/config.properties`` for ``cfg``; returns its path."""
    store = cfg.model_store.resolve()
    if not (store / cfg.mar).is_file():
        raise FileNotFoundError(f"{store / cfg.mar} not found: run `make export` or pass --mar")
    model = {
        cfg.model_name: {
            cfg.model_version: {
                "defaultVersion": True,
                "marName": cfg.mar,
                "minWorkers": cfg.workers,
                "maxWorkers": cfg.workers,
                "batchSize": cfg.batch_size,
                "maxBatchDelay": cfg.max_batch_delay_ms,
                "responseTimeout": cfg.response_timeout_s,
                "startupTimeout": cfg.startup_timeout_s,
            }
        }
    }
    props = {
        "inference_address": f"http://{cfg.host}:{cfg.inference_port}",
        "management_address": f"http://{cfg.host}:{cfg.management_port}",
        "metrics_address": f"http://{cfg.host}:{cfg.metrics_port}",
        "grpc_inference_address": cfg.host,
        "grpc_management_address": cfg.host,
        "grpc_inference_port": cfg.grpc_inference_port,
        "grpc_management_port": cfg.grpc_management_port,
        "model_store": store,
        # both are needed: load_models picks the archive, models= carries its settings
        "load_models": cfg.mar,
        "models": json.dumps(model, separators=(",", ":")),
        "default_workers_per_model": cfg.workers,
        "default_response_timeout": cfg.response_timeout_s,
        "default_startup_timeout": cfg.startup_timeout_s,
        "job_queue_size": cfg.job_queue_size,
        "max_request_size": cfg.max_request_bytes,
        "max_response_size": cfg.max_request_bytes,
        "disable_token_authorization": "false",
        "token_expiration_min": cfg.token_expiration_min,
        "enable_model_api": "false",
        "install_py_dep_per_model": "false",  # the venv is the environment; no pip at load
        "metrics_mode": "prometheus",
        "enable_metrics_api": "true",
        "enable_envvars_config": "false",  # no TS_* variable silently overrides this file
    }
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    path = cfg.workdir / "config.properties"
    body = "".join(f"{k}={v}\n" for k, v in props.items())
    path.write_text(f"# written by serving.torchserve; edits are overwritten on start\n{body}")
    return path


def torchserve_command(cfg: TorchServeConfig, properties: Path) -> list[str]:
    exe = Path(sys.executable).parent / "torchserve"
    return [
        str(exe if exe.exists() else "torchserve"),
        "--start", "--foreground", "--ncs",
        "--model-store", str(cfg.model_store.resolve()),
        "--ts-config", str(properties.resolve()),
    ]  # fmt: skip


def start(cfg: TorchServeConfig) -> subprocess.Popen[bytes]:
    """Start TorchServe in its own process group, in ``cfg.workdir``; returns at once.

    Call ``wait_ready`` next. The group (launcher, java, Python workers) is what ``stop`` ends.
    """
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise FileNotFoundError("java not found: TorchServe 0.12 needs Java 17 (or set JAVA_HOME)")
    workdir = cfg.workdir.resolve()
    properties = write_properties(cfg).resolve()
    tmp = workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    if len(str(tmp)) > 90:  # worker sockets live here; AF_UNIX paths stop at 107 bytes
        raise ValueError(
            f"workdir {workdir} is too deep for TorchServe's sockets: pick a shorter one"
        )
    cfg.key_file.unlink(missing_ok=True)  # a stale key would pass for the new one
    env = dict(os.environ)
    env.update(
        TMPDIR=str(tmp),  # the launcher's pid file ($TMPDIR/.model_server.pid): one per instance
        TEMP=str(tmp),  # java.io.tmpdir: worker sockets .ts.sock.<port>
        LOG_LOCATION=str(workdir / "logs"),
        METRICS_LOCATION=str(workdir / "logs"),
        RECSYS_WORKERS=str(cfg.workers),  # the handler splits the cores among workers
    )
    log = open(workdir / LOG_FILE, "ab")  # noqa: SIM115  the child owns it from here
    try:
        proc = subprocess.Popen(
            torchserve_command(cfg, properties),
            cwd=workdir,  # TorchServe writes key_file.json into its working directory
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()
    logger.info("torchserve started (pid %d), log %s", proc.pid, workdir / LOG_FILE)
    return proc


def read_keys(cfg: TorchServeConfig) -> dict[str, str]:
    """``{"inference": ..., "management": ..., "API": ...}`` from ``key_file.json``."""
    try:
        data = json.loads(cfg.key_file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{cfg.key_file} not found: is TorchServe running there?") from None
    return {kind: entry["key"] for kind, entry in data.items()}


def inference_key(cfg: TorchServeConfig) -> str:
    """The key for ``authorization: Bearer <key>`` on inference calls (REST and gRPC)."""
    return read_keys(cfg)["inference"]


def log_tail(cfg: TorchServeConfig, lines: int = 40) -> str:
    try:
        text = cfg.log_file.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def describe(cfg: TorchServeConfig, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The management API's description of ``cfg``'s model version (raises if unreachable)."""
    url = f"http://{cfg.host}:{cfg.management_port}/models/{cfg.model_name}/{cfg.model_version}"
    key = read_keys(cfg)["management"]
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: list[dict[str, Any]] = json.loads(resp.read())
    return out


def ready_workers(cfg: TorchServeConfig) -> int:
    """Workers of the model in state READY (0 while loading or if TorchServe is unreachable)."""
    try:
        models = describe(cfg)
    except (OSError, ValueError, KeyError):  # not up yet, key file not written yet
        return 0
    return sum(w.get("status") == "READY" for m in models for w in m.get("workers", []))


LOAD_FAILURES_FATAL = 3


def _load_failures(cfg: TorchServeConfig) -> int:
    try:
        return cfg.log_file.read_text(errors="replace").count(
            f"Load model failed: {cfg.model_name},"
        )
    except FileNotFoundError:
        return 0


def _last_worker_error(cfg: TorchServeConfig) -> str:
    """The last ``SomeError: message`` a worker printed, to head the error message."""
    errors = re.findall(r"MODEL_LOG - (\w+(?:Error|Exception): .*)", log_tail(cfg, 400))
    return errors[-1] if errors else "no Python error in the log"


def wait_ready(
    cfg: TorchServeConfig, timeout: float = 180.0, proc: subprocess.Popen[bytes] | None = None
) -> float:
    """Block until the model has a READY worker; returns the seconds waited.

    Raises ``RuntimeError`` with the log tail if ``proc`` exits, the worker fails to load the
    model ``LOAD_FAILURES_FATAL`` times, or ``timeout`` passes (Java startup plus the model
    load take ~10-30 s on 2 cores).
    """
    t0 = time.monotonic()
    while True:
        if ready_workers(cfg) > 0:
            return time.monotonic() - t0
        failures = _load_failures(cfg)
        if failures >= LOAD_FAILURES_FATAL:  # TorchServe would retry forever, backing off
            raise RuntimeError(
                f"{cfg.model_name}/{cfg.model_version}: the worker failed to load the model"
                f" {failures} times, last with {_last_worker_error(cfg)!r};"
                f" {cfg.log_file} ends with:\n{log_tail(cfg)}"
            )
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"torchserve exited with {proc.returncode} before {cfg.model_name} was ready;"
                f" {cfg.log_file} ends with:\n{log_tail(cfg)}"
            )
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(
                f"{cfg.model_name}/{cfg.model_version} has no READY worker after {timeout:.0f} s;"
                f" {cfg.log_file} ends with:\n{log_tail(cfg)}"
            )
        time.sleep(0.25)


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of process group ``pgid``."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def _signal_group(pgid: int, sig: signal.Signals, spare_leader: bool) -> None:
    for p in group_members(pgid):
        if spare_leader and p.pid == pgid:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)


def _wait_group_empty(proc: subprocess.Popen[bytes] | int, grace: float) -> bool:
    pgid = proc if isinstance(proc, int) else proc.pid
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not isinstance(proc, int):
            proc.poll()  # reap the launcher
        if not group_members(pgid):
            return True
        time.sleep(0.1)
    return False


def stop(proc: subprocess.Popen[bytes] | int, timeout: float = 30.0) -> None:
    """Stop TorchServe's process group (launcher, java, workers): SIGTERM, then SIGKILL.

    ``proc``: the ``Popen`` from ``start`` or the group id (the launcher's pid). Java and the
    workers get SIGTERM first and the launcher exits once java has (it waits on it, and reaps
    it: no zombie java where PID 1 does not reap); what outlives ``timeout`` is killed.
    """
    pgid = proc if isinstance(proc, int) else proc.pid
    _signal_group(pgid, signal.SIGTERM, spare_leader=True)
    if not _wait_group_empty(proc, timeout):
        logger.warning("torchserve group %d outlived SIGTERM by %.0f s: killing it", pgid, timeout)
        _signal_group(pgid, signal.SIGKILL, spare_leader=False)
        _wait_group_empty(proc, 5.0)
    if not isinstance(proc, int):
        proc.wait(timeout=5)
    left = group_members(pgid)
    if left:
        raise RuntimeError(f"torchserve processes survived SIGKILL: {[p.pid for p in left]}")


class RequestRejected(ValueError):
    """The handler refused the request (e.g. a malformed body); the message is its reason."""


def score_grpc(
    channel: Any, cfg: TorchServeConfig, body: bytes, timeout: float, key: str | None = None
) -> bytes:
    """One ``Predictions`` call with an RSB1 ``body`` (see serving.codec); returns the raw reply.

    ``channel``: a ``grpc.Channel`` to ``cfg.grpc_inference_target``; ``key``: the inference
    key (read from the key file when None). Transport, auth (PERMISSION_DENIED) and server
    errors surface as ``grpc.RpcError``. A body the handler refuses raises ``RequestRejected``:
    TorchServe 0.12's gRPC ``Predictions`` drops the per-request status the handler sets (REST
    answers 400) and returns OK with the handler's message as the prediction.
    """
    from serving.codec import REJECTION  # the handler's prefix for a body it refused
    from serving.protos import ensure_generated

    ensure_generated()
    from serving._gen import inference_pb2, inference_pb2_grpc

    stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
    request = inference_pb2.PredictionsRequest(
        model_name=cfg.model_name, model_version=cfg.model_version, input={"data": body}
    )
    metadata = (("authorization", f"Bearer {key or inference_key(cfg)}"),)
    prediction = bytes(stub.Predictions(request, timeout=timeout, metadata=metadata).prediction)
    if prediction.startswith(REJECTION):
        raise RequestRejected(prediction.decode(errors="replace"))
    return prediction


# --- CLI (make serve / make stop) -------------------------------------------------------------


def _read_pid(cfg: TorchServeConfig) -> int | None:
    try:
        pid = int((cfg.workdir / PID_FILE).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if group_members(pid) else None


def _config_from_args(ns: argparse.Namespace) -> TorchServeConfig:
    cfg = TorchServeConfig(workdir=ns.workdir, model_store=ns.model_store)
    if ns.command == "start":
        mar = ns.mar or _newest_mar(ns.model_store)
        name, version = model_from_mar(ns.model_store / mar)
        cfg.mar_file, cfg.model_name, cfg.model_version = mar, name, version
        cfg.workers, cfg.batch_size = ns.workers, ns.batch_size
        cfg.max_batch_delay_ms = ns.max_batch_delay_ms
    else:  # stop/status describe what start recorded
        state = cfg.workdir / "model.json"
        if state.is_file():
            saved = json.loads(state.read_text())
            cfg.model_name, cfg.model_version = saved["name"], saved["version"]
    return cfg


def _newest_mar(store: Path) -> str:
    mars = sorted(store.glob("*.mar"), key=lambda p: p.stat().st_mtime)
    if not mars:
        raise FileNotFoundError(f"no .mar in {store}: run `make export` first")
    return mars[-1].name


def main(argv: list[str] | None = None) -> int:
    d = TorchServeConfig()
    p = argparse.ArgumentParser(
        prog="python -m serving.torchserve",
        description="Start, stop or check a local TorchServe serving one model archive. Ports "
        f"come from {', '.join(PORT_ENV.values())} (defaults 8080/8081/8082/7070/7071).",
    )
    p.add_argument("command", choices=["start", "stop", "status"])
    p.add_argument(
        "--workdir",
        type=Path,
        default=d.workdir,
        help=f"state folder (env {WORKDIR_ENV}; default %(default)s)",
    )
    p.add_argument("--model-store", type=Path, default=d.model_store, help="default %(default)s")
    p.add_argument("--mar", default="", help="archive in the model store (default: the newest)")
    p.add_argument("--workers", type=int, default=d.workers, help="default %(default)s")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="default %(default)s")
    p.add_argument(
        "--max-batch-delay-ms", type=int, default=d.max_batch_delay_ms, help="default %(default)s"
    )
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for start/stop")
    ns = p.parse_args(argv)  # fmt: skip
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return _run(ns)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(ns: argparse.Namespace) -> int:
    cfg = _config_from_args(ns)
    pid = _read_pid(cfg)
    if ns.command == "start":
        if pid is not None:
            print(f"torchserve already running (pid {pid}, {cfg.workdir}); `stop` it first")
            return 1
        proc = start(cfg)
        (cfg.workdir / PID_FILE).write_text(f"{proc.pid}\n")
        (cfg.workdir / "model.json").write_text(
            json.dumps({"name": cfg.model_name, "version": cfg.model_version})
        )
        try:
            secs = wait_ready(cfg, ns.timeout, proc)
        except RuntimeError:
            stop(proc)
            (cfg.workdir / PID_FILE).unlink(missing_ok=True)
            raise
        print(
            f"torchserve ready in {secs:.1f} s: {cfg.model_name}/{cfg.model_version} on gRPC "
            f"{cfg.grpc_inference_target}, REST {cfg.host}:{cfg.inference_port}; "
            f"keys {cfg.key_file}, log {cfg.log_file}"
        )
        return 0
    if ns.command == "stop":
        if pid is None:
            print(f"torchserve is not running ({cfg.workdir})")
        else:
            stop(pid, timeout=ns.timeout)
            print(f"torchserve stopped (pid {pid})")
        (cfg.workdir / PID_FILE).unlink(missing_ok=True)
        cfg.key_file.unlink(missing_ok=True)
        return 0
    if pid is None:
        print(f"torchserve is not running ({cfg.workdir})")
        return 3
    n = ready_workers(cfg)
    print(
        f"torchserve running (pid {pid}): {cfg.model_name}/{cfg.model_version}, {n} READY workers"
    )
    return 0 if n else 2


if __name__ == "__main__":
    sys.exit(main())
