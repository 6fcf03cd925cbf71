"""Container entry for TorchServe: foreground, all interfaces, logs on stdout, graceful SIGTERM.

``python -m serving.torchserve start`` is made for a workstation: it binds 127.0.0.1 (the
gateway is the public face), starts TorchServe in its own session and returns once the model is
READY, leaving it in the background. In a container the gateway is another host on the compose
network and PID 1 must stay alive, so this script reuses ``serving.torchserve`` (same
config.properties, token auth on, model API off) with ``host=0.0.0.0``, stays in the foreground
copying TorchServe's log to stdout, and on SIGTERM stops the whole group (launcher, java,
workers) with ``serving.torchserve.stop``.

The key file is generated at start into ``<workdir>/key_file.json`` (a volume the gateway
mounts read-only); nothing secret is in the image.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from serving import torchserve as ts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python docker/torchserve_entry.py", description=__doc__)
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(env(ts.WORKDIR_ENV, "/shared/ts")),
        help=f"state folder: config, key_file.json, logs (env {ts.WORKDIR_ENV})",
    )
    p.add_argument(
        "--model-store",
        type=Path,
        default=Path(env("RECSYS_MODEL_STORE", "model_store")),
        help="folder of .mar files (env RECSYS_MODEL_STORE)",
    )
    p.add_argument(
        "--mar",
        default=env("RECSYS_MODEL_MAR", ""),
        help="archive to serve (env RECSYS_MODEL_MAR; default: the newest)",
    )
    p.add_argument(
        "--host",
        default=env("RECSYS_TS_HOST", "0.0.0.0"),
        help="bind address of every TorchServe API (env RECSYS_TS_HOST)",
    )
    p.add_argument("--workers", type=int, default=int(env("RECSYS_TS_WORKERS", "1")))
    p.add_argument("--batch-size", type=int, default=int(env("RECSYS_TS_BATCH_SIZE", "8")))
    p.add_argument(
        "--max-batch-delay-ms", type=int, default=int(env("RECSYS_TS_MAX_BATCH_DELAY_MS", "5"))
    )
    return p.parse_args(argv)  # fmt: skip


def newest_mar(store: Path) -> str:
    mars = sorted(store.glob("*.mar"), key=lambda p: p.stat().st_mtime)
    if not mars:
        raise FileNotFoundError(f"no .mar in {store}: run the export service (profile train)")
    return mars[-1].name


def config(ns: argparse.Namespace) -> ts.TorchServeConfig:
    mar = ns.mar or newest_mar(ns.model_store)
    name, version = ts.model_from_mar(ns.model_store / mar)
    return ts.TorchServeConfig(
        host=ns.host, model_store=ns.model_store, workdir=ns.workdir, mar_file=mar,
        model_name=name, model_version=version, workers=ns.workers,
        batch_size=ns.batch_size, max_batch_delay_ms=ns.max_batch_delay_ms,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config(parse_args(argv))
        proc = ts.start(cfg)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"torchserve: {cfg.model_name}/{cfg.model_version} on {cfg.host}, keys {cfg.key_file}",
          flush=True)  # fmt: skip
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: stopping.append(s))
    offset = 0
    while True:
        offset = copy_log(cfg.log_file, offset)
        if stopping:
            ts.stop(proc)
            copy_log(cfg.log_file, offset)
            return 0
        if proc.poll() is not None:
            copy_log(cfg.log_file, offset)
            return proc.returncode or 1
        time.sleep(0.5)


def copy_log(path: Path, offset: int) -> int:
    """Write what ``path`` gained since ``offset`` to stdout; returns the new offset."""
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
