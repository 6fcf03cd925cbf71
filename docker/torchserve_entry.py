"""Container entry for TorchServe: foreground, logs on stdout, graceful SIGTERM.

The supervisor (``make serve``) is made for a workstation: it starts TorchServe in its own
session and returns once the model is READY, leaving it in the background. In a container PID 1
must stay alive, so this script starts the same TorchServe (``serving.torchserve``: same
``TorchServeConfig`` through the same loader, same config.properties, token auth on, model API
off as compose sets ``RECSYS_TS_MODEL_API=false``), stays in the foreground copying
TorchServe's log to stdout, and on SIGTERM drains and stops the whole group (java first: it answers the calls its workers
hold and closes its ports, then the launcher and workers go; ``process.stop``).

Configured like every entry point: ``--config FILE.toml``, flags, ``key=value`` and the
variables ``python docker/torchserve_entry.py --help`` lists (``RECSYS_TS_*`` ports, workers,
batching; ``RECSYS_MODEL_STORE``, ``RECSYS_MODEL_MAR``, empty = the newest archive). The image
sets ``RECSYS_TS_HOST=0.0.0.0`` (the gateway is another host on the compose network) and
``RECSYS_TS_WORKDIR=/shared/ts``. The key file is generated at start into
``<workdir>/key_file.json`` (this container's own volume); with ``RECSYS_TS_INFERENCE_KEY_FILE``
set, its inference key alone is copied there (mode 0600, replaced atomically whenever TorchServe
writes new keys): that is the file the gateway mounts, so it never holds management keys. A
``{host}`` in that path is this replica's address (``RECSYS_TS_ADVERTISE_HOST``, else what the
container's hostname resolves to: its address on the compose network or the pod's IP), so
replicas of one scaled service each write their own, ``/keys/{host}.json``, and a gateway that
finds them by name (``--backend dns:///torchserve:7070 --key-file /keys/{host}.json``) reads
each one's key by the address it resolved. Nothing secret is in the image. With
``RECSYS_TS_PROBE_PORT`` set (deploy/k8s: 8083), ``GET /readyz`` and ``/livez`` on that port
answer a kubelet's probes from the management API's last answer (serving/torchserve/probe.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from recsys_stack.config import ConfigError, parse
from serving.torchserve import probe, process
from serving.torchserve.config import TorchServeConfig, resolve_model
from serving.torchserve.keys import KeyFileError, write_inference_copy

INFERENCE_KEY_ENV = "RECSYS_TS_INFERENCE_KEY_FILE"
ADVERTISE_ENV = "RECSYS_TS_ADVERTISE_HOST"
STOP_S = 15.0  # the drain's bound (java answers its calls, then the rest); compose grants 20 s


def advertised_host() -> str:
    """This replica's address as the gateway resolves it (see the module's docstring)."""
    if host := os.environ.get(ADVERTISE_ENV):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise ValueError(
            f"{socket.gethostname()} does not resolve ({e}): set {ADVERTISE_ENV} to this "
            "replica's address"
        ) from None


def main(argv: list[str] | None = None) -> int:
    try:
        doc = __doc__.split("\n\n")[0]
        cfg = resolve_model(parse(TorchServeConfig, argv, "python docker/torchserve_entry.py", doc))
        share = os.environ.get(INFERENCE_KEY_ENV, "")
        if "{host}" in share:
            share = share.replace("{host}", advertised_host())
        proc = process.start(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"torchserve: {cfg.model_name}/{cfg.model_version} on {cfg.host}, keys {cfg.key_file}",
          flush=True)  # fmt: skip
    stop_probes = start_probes(cfg, proc)
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: stopping.append(s))
    at, copied = (0, 0), -1
    while True:
        at = copy_log(cfg.log_file, at)
        if share:
            copied = share_inference_key(cfg.key_file, Path(share), copied)
        if stopping:
            stop_probes.set()
            process.stop(proc, timeout=STOP_S)
            copy_log(cfg.log_file, at)
            return 0
        if proc.poll() is not None:
            copy_log(cfg.log_file, at)
            return proc.returncode or 1
        time.sleep(0.5)


def start_probes(cfg: TorchServeConfig, proc: subprocess.Popen[bytes]) -> threading.Event:
    """The kubelet's HTTP probes on ``RECSYS_TS_PROBE_PORT`` (none when unset or 0); set the
    event returned to stop asking the management API."""
    stop = threading.Event()
    port = int(os.environ.get(probe.PORT_ENV) or 0)
    if port:
        probes = probe.Probes(lambda: process.describe(cfg, 3.0), lambda: proc.poll() is None)
        probe.serve(probes, port)
        threading.Thread(target=probes.run, args=(stop,), name="probe-check", daemon=True).start()
        print(f"torchserve: probes on :{port} (/readyz, /livez)", flush=True)
    return stop


def share_inference_key(keys: Path, out: Path, copied: int) -> int:
    """Copy the inference key of ``keys`` to ``out`` (``{"inference": {"key": ...}}``, mode
    0600, atomic rename) when ``keys`` changed since mtime ``copied``; returns the new mtime."""
    try:
        mtime = keys.stat().st_mtime_ns
        if mtime == copied:
            return copied
        write_inference_copy(keys, out)
    except (OSError, KeyFileError):
        return copied  # not written yet
    print(f"torchserve: inference key shared in {out}", flush=True)
    return mtime


def copy_log(path: Path, at: tuple[int, int]) -> tuple[int, int]:
    """Write what ``path`` gained since ``at`` (its inode, an offset) to stdout; returns the new
    position. The log rotates by size (recsys_stack/logpump.py): a new inode means the rest of
    the old file is ``path.1``, copied first; a shorter file (one file kept), read from 0."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return at
    ino, offset = at
    if ino and st.st_ino != ino:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(f"{path}.1").st_ino == ino:
                _copy(Path(f"{path}.1"), offset)
        offset = 0
    elif st.st_size < offset:
        offset = 0
    return st.st_ino, _copy(path, offset)


def _copy(path: Path, offset: int) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return offset
    sys.stdout.buffer.write(chunk)
    sys.stdout.flush()
    return offset + len(chunk)


if __name__ == "__main__":
    sys.exit(main())
