"""``python -m serving.lite MAR``: unpack a ``.mar`` and run its lite workers until stopped.

    python -m serving.lite model_store/dlrm-3.mar --workers 2 --port 7200 --dir runs/lite

Each worker (serving/lite/worker.py) is one process with ``cores / workers`` intra-op threads,
serving TorchServe's gRPC inference API on its own port and the same calls on its own Unix
socket (``DIR/sockets/PORT.sock``, serving/lite/frames.py), with its own key file. Once all
are ready it prints them as JSON (``{"backend": ..., "key_file": ...}``), then the gateway's
command that reaches them, over the sockets (``--transport grpc``: over gRPC)::

    gateway: python -m serving.gateway --schema runs/lite/dlrm-3/schema.json \
        --backend lite:/abs/runs/lite/sockets/7200.sock,lite:/abs/runs/lite/sockets/7201.sock \
        --key-file '/abs/runs/lite/keys/7200.json,/abs/runs/lite/keys/7201.json' --hedge.ratio 0

Hedging off (``GATEWAY_SETTINGS``, also in the JSON): the workers share one machine's cores,
so a hedged copy of a slow call only doubles the work (``python -m serving.bench``, 100
examples x 16 / 64 callers: 45,773 / 49,941 examples/s with the gateway's default hedging,
56,171 / 59,414 without).

A worker that exits is started again (1 s later, backing off to 30 s while it keeps failing;
back to 1 s once it has run a minute);
SIGTERM or Ctrl-C stops them all. TorchServe stays the stack's default backend: this one has no
management API (no rollouts, no scaling), see serving/lite/__init__.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from recsys_stack.cpus import available_cpus
from recsys_stack.net import free_ports
from serving.lite import GATEWAY_SETTINGS
from serving.lite.frames import SCHEME, check_path

RESTART_S = (1.0, 30.0)  # a failed worker's first and longest wait before it starts again
STEADY_S = 60.0  # a worker that ran this long before it exited is restarted after RESTART_S[0]


def unpack(mar: Path, into: Path) -> Path:
    """``mar`` unpacked under ``into`` (as TorchServe unpacks it: every file at the top, the
    manifest in MAR-INF/), once: a folder already unpacked from the same file is reused."""
    stamp = f"{mar.resolve()} {mar.stat().st_size} {mar.stat().st_mtime_ns}"
    dest = into / mar.stem
    if (dest / ".unpacked-from").is_file() and (dest / ".unpacked-from").read_text() == stamp:
        return dest
    tmp = into / f".{mar.stem}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(mar) as z:
            z.extractall(tmp)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{mar} is not a .mar (zip): {e}") from None
    if not (tmp / "MAR-INF" / "MANIFEST.json").is_file():
        shutil.rmtree(tmp, ignore_errors=True)
        raise ValueError(f"{mar} has no MAR-INF/MANIFEST.json: not a .mar made by make export")
    (tmp / ".unpacked-from").write_text(stamp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


@dataclass
class Pool:
    """The running workers of one unpacked model."""

    model_dir: Path
    ports: list[int]
    keys: Path
    host: str = "127.0.0.1"
    threads: int = 1
    gpus: int = 0
    procs: list[subprocess.Popen[bytes] | None] = field(init=False)
    """Each port's worker process (None until started)."""
    started: list[float] = field(init=False)
    """When each was last started (monotonic)."""

    def __post_init__(self) -> None:
        self.procs = [None] * len(self.ports)
        self.started = [0.0] * len(self.ports)

    def key_file(self, port: int) -> Path:
        return self.keys / f"{port}.json"

    def socket(self, port: int) -> Path:
        return socket_path(self.keys.parent, port)

    def door(self, transport: str) -> dict[str, str]:
        """The gateway's ``backend`` and ``key_file`` for the workers' ``transport``:
        ``socket`` (each worker's socket, ``lite:PATH``, and its own key file, in that order)
        or ``grpc`` (their addresses, and a key file template filled with each port)."""
        if transport == "socket":
            sockets = ",".join(f"{SCHEME}{self.socket(p)}" for p in self.ports)
            keys = ",".join(str(self.key_file(p).resolve()) for p in self.ports)
            return {"backend": sockets, "key_file": keys}
        addresses = ",".join(f"{self.host}:{p}" for p in self.ports)
        return {"backend": addresses, "key_file": str(self.keys.resolve() / "{port}.json")}

    def start(self, i: int) -> None:
        """Start the worker of ``self.ports[i]`` (its process goes in ``self.procs[i]``)."""
        env = {
            **os.environ,
            "RECSYS_THREADS": str(self.threads),
            "OMP_NUM_THREADS": str(self.threads),
            "RECSYS_REPLICA_WORKERS": "1",  # each worker is a replica of one (its describe)
        }
        gpu = ["--gpu", str(i % self.gpus)] if self.gpus else []
        cmd = [sys.executable, "-m", "serving.lite.worker", str(self.model_dir),
               "--port", str(self.ports[i]), "--host", self.host,
               "--key-file", str(self.key_file(self.ports[i])),
               "--socket", str(self.socket(self.ports[i])), *gpu]  # fmt: skip
        self.procs[i] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE)
        self.started[i] = time.monotonic()

    def start_all(self, timeout: float) -> None:
        """Start every worker; return once each says it is ready (RuntimeError naming the
        first that exits or does not within ``timeout``)."""
        for i in range(len(self.ports)):
            self.start(i)
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(self.procs):
            assert proc is not None
            wait_ready(proc, deadline, f"lite worker {i} (port {self.ports[i]})")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM every worker, SIGKILL what has not exited within ``timeout``."""
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def supervise(self, stopping: list[bool]) -> None:
        """Restart workers that exit, until ``stopping[0]``."""
        waits = [RESTART_S[0]] * len(self.ports)
        due = [0.0] * len(self.ports)
        while not stopping[0]:
            time.sleep(0.2)
            for i, proc in enumerate(self.procs):
                if proc is None or proc.poll() is None or stopping[0]:
                    continue
                now = time.monotonic()
                if not due[i]:
                    if now - self.started[i] > STEADY_S:  # it ran a while: a new failure streak
                        waits[i] = RESTART_S[0]
                    print(f"lite worker {i} (port {self.ports[i]}) exited {proc.returncode}; "
                          f"starting it again in {waits[i]:.0f} s", file=sys.stderr)  # fmt: skip
                    due[i] = now + waits[i]
                    waits[i] = min(RESTART_S[1], waits[i] * 2)
                elif now >= due[i]:
                    due[i] = 0.0
                    self.start(i)


def wait_ready(proc: subprocess.Popen[bytes], deadline: float, name: str) -> None:
    """Block until ``proc`` prints ``ready``; RuntimeError if it exits or ``deadline`` passes."""
    assert proc.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{name} not ready in time")
        readable, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if readable:
            line = proc.stdout.readline()
            if line.startswith(b"ready"):
                return
            if not line and proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode} before it was ready")
        elif proc.poll() is not None:
            raise RuntimeError(f"{name} exited {proc.returncode} before it was ready")


def socket_path(folder: Path, port: int) -> Path:
    """The Unix socket of the worker of ``port`` (in a 0700 folder beside the keys)."""
    return folder.resolve() / "sockets" / f"{port}.sock"


def pool_for(
    mar: Path, workers: int, port: int, folder: Path, host: str = "127.0.0.1", gpus: int = 0
) -> Pool:
    """A pool (not started) of ``workers`` (0: the CPUs this process may use) for ``mar``,
    unpacked under ``folder``, on ports ``port``.. (0: free ones); ValueError, before
    anything is written, for a folder too deep for the workers' sockets."""
    n = workers or available_cpus()
    ports = free_ports(n, host) if port == 0 else list(range(port, port + n))
    for p in ports:
        check_path(str(socket_path(folder, p)))
    cores = available_cpus()
    model_dir = unpack(mar, folder)
    return Pool(model_dir, ports, folder / "keys", host, max(1, cores // n), gpus)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m serving.lite",
        description="Serve a .mar with lite workers: the stack's handler behind TorchServe's "
        "gRPC inference API, one process per worker, no TorchServe frontend. Prints the "
        "gateway settings that reach them.",
    )
    p.add_argument("mar", type=Path, help="the model archive (model_store/<name>-<version>.mar)")
    p.add_argument("--workers", type=int, default=0, help="worker processes (0 = cores)")
    p.add_argument("--port", type=int, default=7200, help="first worker's port (0 = free ports)")
    p.add_argument("--host", default="127.0.0.1", help="address the workers listen on")
    p.add_argument("--dir", type=Path, default=Path("runs/lite"),
                   help="where the .mar is unpacked and the key files go")  # fmt: skip
    p.add_argument("--transport", choices=("socket", "grpc"), default="socket",
                   help="how the printed gateway command reaches the workers: their Unix sockets "
                   "(lite:PATH, the default, the lighter path) or TorchServe's gRPC API on their "
                   "ports (both are served)")  # fmt: skip
    p.add_argument("--gpus", type=int, default=0, help="CUDA devices to spread workers over")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.mar.is_file():
        print(f"error: {args.mar} not found: make export writes model_store/<name>-<version>.mar",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.workers < 0:
        print("error: --workers must be >= 0 (0 = one per core)", file=sys.stderr)
        return 2
    stopping = [False]

    def stop(signum: int, frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        pool = pool_for(args.mar, args.workers, args.port, args.dir, args.host, args.gpus)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        pool.start_all(args.timeout)
        door = pool.door(args.transport)
        print(json.dumps({**door, **GATEWAY_SETTINGS, "grpc": pool.door("grpc")}))
        print(f"gateway: python -m serving.gateway --schema {pool.model_dir / 'schema.json'} "
              f"--backend {door['backend']} --key-file '{door['key_file']}' --hedge.ratio 0",
              flush=True)  # fmt: skip
        pool.supervise(stopping)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(Exception):
            pool.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
