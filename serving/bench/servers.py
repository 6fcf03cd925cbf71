"""The servers under test, started side by side on free ports and always stopped.

* the stack's TorchServe (``serving.torchserve.process``, the config ``make serve`` writes) with
  the gateway (``serving.tools.supervisor.launch_gateway``) in front of it;
* the peer: a second TorchServe with TorchServe's defaults (workers = cores, batch size 1, its
  own timeouts and queue) serving a .mar of the same TorchScript artifact with
  ``plain_handler.py``. Its ``config.properties`` holds only what two instances on one machine
  must not share: addresses, ports, the store and the model to load.

Every process is registered on an ``ExitStack`` as soon as it exists, so an error, Ctrl-C or
SIGTERM stops all of them (TorchServe's whole process group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from recsys_stack.net import free_ports
from serving.bench.config import LITE, LITE_GRPC, LOGGED
from serving.gateway.config import GatewayConfig
from serving.lite import GATEWAY_SETTINGS
from serving.tools.supervisor import launch_gateway, wait_serving
from serving.torchserve import process
from serving.torchserve.config import TorchServeConfig, on_free_ports

PLAIN_HANDLER = Path(__file__).with_name("plain_handler.py")
PLAIN = ("plain", "1")  # the peer's model name and version


def archive_plain(artifact: Path, store: Path) -> str:
    """``plain-1.mar`` in ``store``: ``artifact`` with the plain handler; returns its name."""
    store.mkdir(parents=True, exist_ok=True)
    archiver = Path(sys.executable).parent / "torch-model-archiver"
    cmd = [
        str(archiver if archiver.exists() else "torch-model-archiver"),
        "--model-name", PLAIN[0], "--version", PLAIN[1], "--serialized-file", str(artifact),
        "--handler", str(PLAIN_HANDLER), "--export-path", str(store), "--force",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"torch-model-archiver (plain): {proc.stderr.strip()[-500:]}")
    return f"{PLAIN[0]}.mar"


def start_plain(
    cfg: TorchServeConfig, threads: int, stack: contextlib.ExitStack
) -> subprocess.Popen[bytes]:
    """TorchServe with its defaults for the peer's ``cfg`` (ports, store, workdir, model),
    ``OMP_NUM_THREADS=threads`` in its workers (0: unset, torch's default)."""
    home = cfg.workdir.resolve()
    home.mkdir(parents=True, exist_ok=True)
    props = home / "config.properties"
    props.write_text(
        f"inference_address=http://{cfg.host}:{cfg.inference_port}\n"
        f"management_address=http://{cfg.host}:{cfg.management_port}\n"
        f"metrics_address=http://{cfg.host}:{cfg.metrics_port}\n"
        f"grpc_inference_address={cfg.host}\ngrpc_management_address={cfg.host}\n"
        f"grpc_inference_port={cfg.grpc_inference_port}\n"
        f"grpc_management_port={cfg.grpc_management_port}\n"
        f"model_store={cfg.model_store.resolve()}\nload_models={cfg.mar}\n"
    )
    proc = process.launch(cfg, props, {"OMP_NUM_THREADS": str(threads) if threads else None})
    stack.callback(process.stop, proc)
    return proc


def start_stack_torchserve(
    cfg: TorchServeConfig, stack: contextlib.ExitStack
) -> subprocess.Popen[bytes]:
    proc = process.start(cfg)
    stack.callback(process.stop, proc)
    return proc


def wait_all_workers(cfg: TorchServeConfig, proc: subprocess.Popen[bytes], timeout: float) -> int:
    """Block until every worker of ``cfg``'s model is READY; returns their number."""
    deadline = time.monotonic() + timeout
    process.wait_ready(cfg, timeout, proc)
    while True:
        workers = [w for m in process.describe(cfg) for w in m.get("workers", [])]
        if workers and all(w.get("status") == "READY" for w in workers):
            return len(workers)
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{cfg.model_name}: not all workers READY; see {cfg.log_file}")
        time.sleep(0.25)


def model_settings(cfg: TorchServeConfig) -> dict[str, Any]:
    """Workers, batch size, delay as TorchServe reports them, and the threads each worker uses."""
    model = process.describe(cfg)[0]
    threads = re.findall(r"MODEL_LOG - .*handler.*\((?:\w+ )?(\d+) threads\)|handler: (\d+) threads",
                         cfg.log_file.read_text(errors="replace"))  # fmt: skip
    return {
        "workers": len(model.get("workers", [])),
        "batch_size": model.get("batchSize"),
        "max_batch_delay_ms": model.get("maxBatchDelay"),
        "threads_per_worker": sorted({int(a or b) for a, b in threads}),
    }


def torchserve_backend(ts: TorchServeConfig) -> tuple[str, str]:
    """The gateway's (backend, key_file) for the TorchServe ``ts``."""
    return ts.grpc_inference_target, str(ts.key_file.resolve())


def start_gateway(
    gcfg: GatewayConfig, backend: tuple[str, str], schema: Path, log: Path,
    stack: contextlib.ExitStack,
) -> tuple[GatewayConfig, subprocess.Popen[bytes]]:  # fmt: skip
    """The gateway in front of ``backend`` = (address(es), key file(s)) on a free port; stopped
    (SIGTERM, then SIGKILL) on exit."""
    gcfg = dataclasses.replace(
        gcfg, schema=schema.resolve(), host="127.0.0.1", port=free_ports(1)[0],
        backend=backend[0], key_file=backend[1],
    )  # fmt: skip
    proc = launch_gateway(gcfg, log)
    stack.callback(_stop_gateway, proc)
    return gcfg, proc


def _stop_gateway(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def start_relay(
    ts: TorchServeConfig, stack: contextlib.ExitStack
) -> tuple[str, subprocess.Popen[bytes]]:
    """serving/bench/relay.py in front of ``ts`` on a free port; (target, process)."""
    port = free_ports(1)[0]
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.bench.relay", str(port), ts.grpc_inference_target],
        stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    stack.callback(_stop_gateway, proc)  # SIGTERM, then the group
    if proc.stdout is None or proc.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"the relay did not start (exit code {proc.poll()})")
    return f"127.0.0.1:{port}", proc


def start_lite(
    mar: Path, workers: int, work: Path, timeout: float, stack: contextlib.ExitStack
) -> tuple[dict[str, tuple[str, str]], subprocess.Popen[bytes]]:
    """``python -m serving.lite`` serving ``mar`` with ``workers`` workers on free ports;
    ((backend, key files) for a gateway per lite method: the workers' sockets, their gRPC
    ports; the launcher, whose children they are)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.lite", str(mar), "--workers", str(workers),
         "--port", "0", "--dir", str(work / "lite"), "--timeout", str(timeout)],
        stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    stack.callback(_stop_gateway, proc)  # SIGTERM (it stops its workers), then the group
    line = proc.stdout.readline() if proc.stdout is not None else b""
    if not line.startswith(b"{"):
        raise RuntimeError(f"the lite workers did not start (exit code {proc.poll()})")
    said = json.loads(line)
    grpc_door = said["grpc"]
    return {LITE: (said["backend"], said["key_file"]),
            LITE_GRPC: (grpc_door["backend"], grpc_door["key_file"])}, proc  # fmt: skip


def start_all(
    model: Any, ts: TorchServeConfig, gcfg: GatewayConfig, work: Path, timeout: float,
    stack: contextlib.ExitStack, plain_threads: int | None, want_stack: bool, want_gateway: bool,
    want_relay: bool = False, want_logged: bool = False, lite: Sequence[str] = (),
) -> dict[str, Any]:  # fmt: skip
    """Start what the chosen methods need (both TorchServes at once; the peer unless
    ``plain_threads`` is None); their configs."""
    out: dict[str, Any] = {}
    started = []
    if plain_threads is not None:
        store = work / "plain-store"
        mar = archive_plain(model.plain_artifact, store)
        plain = on_free_ports(TorchServeConfig(
            model_store=store, mar_file=mar, model_name=PLAIN[0], model_version=PLAIN[1],
            workdir=work / "plain-ts", log_config="default",  # the peer: TorchServe's logging
        ))  # fmt: skip
        started.append(("plain", plain, start_plain(plain, plain_threads, stack)))
    if want_stack:
        stack_ts = on_free_ports(dataclasses.replace(ts, workdir=work / "stack-ts"))
        started.append(("stack", stack_ts, start_stack_torchserve(stack_ts, stack)))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for key, cfg, proc in started:
        wait_all_workers(cfg, proc, timeout)
        out[key] = cfg
        procs[key] = proc
    gateways = [("gateway", gcfg)] if want_gateway else []
    if want_logged:  # the same gateway, its feature log on (every example: sample 1); its
        # HTTP port any free one (the first gateway holds the configured one)
        flog = dataclasses.replace(gcfg.feature_log, enabled=True, dir=str(work / "feature_log"),
                                   sample=1.0, key_file="")  # fmt: skip
        gateways.append((LOGGED, dataclasses.replace(gcfg, feature_log=flog, http_port=0)))
    backends = {key: torchserve_backend(out["stack"]) for key, _ in gateways}
    if lite:  # as many lite workers as the stack's TorchServe runs; a gateway per door
        doors, procs["lite"] = start_lite(ts.model_store / ts.mar, ts.worker_count(), work,
                                          timeout, stack)  # fmt: skip
        # each gateway as the launcher prints it: hedging off (the workers share the cores)
        hedge = dataclasses.replace(gcfg.hedge, ratio=GATEWAY_SETTINGS["hedge"]["ratio"])
        for key in lite:
            backends[key] = doors[key]
            gateways.append((key, dataclasses.replace(gcfg, http_port=0, hedge=hedge)))
    for key, g in gateways:
        g, gw = start_gateway(g, backends[key], model.export / "schema.json",
                              work / f"{key}.log", stack)  # fmt: skip
        wait_serving(f"127.0.0.1:{g.port}", gw, timeout)
        out[key] = g
        procs[key] = gw
    if want_relay:
        out["relay"], procs["relay"] = start_relay(out["stack"], stack)
    out["procs"] = procs
    return out


def machine_seconds() -> tuple[float, float]:
    """``(busy, all)`` CPU seconds of the whole machine since boot, every core (``/proc/stat``;
    idle and iowait are not busy): whether a cell left cores idle, whoever ran on them."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - fields[3] - fields[4]) / tick, sum(fields) / tick


def cpu_seconds(proc: subprocess.Popen[bytes]) -> float:
    """User + system CPU seconds of ``proc`` and its live descendants (TorchServe: launcher,
    Java frontend, Python workers)."""
    total = 0.0
    try:
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
    except psutil.Error:
        pass
    return total
