"""Container entry for TorchServe: foreground, logs on stdout, graceful SIGTERM.

The supervisor (``make serve``) is made for a workstation: it starts TorchServe in its own
session and returns once the model is READY, leaving it in the background. In a container PID 1
must stay alive, so this script starts the same TorchServe (``serving.torchserve``: same
``TorchServeConfig`` through the same loader, same config.properties, token auth on, model API
off), stays in the foreground copying TorchServe's log to stdout, and on SIGTERM stops the
whole group (launcher, java, workers).

Configured like every entry point: ``--config FILE.toml``, flags, ``key=value`` and the
variables ``python docker/torchserve_entry.py --help`` lists (``RECSYS_TS_*`` ports, workers,
batching; ``RECSYS_MODEL_STORE``, ``RECSYS_MODEL_MAR``, empty = the newest archive). The image
sets ``RECSYS_TS_HOST=0.0.0.0`` (the gateway is another host on the compose network) and
``RECSYS_TS_WORKDIR=/shared/ts``. The key file is generated at start into
``<workdir>/key_file.json`` (a volume the gateway mounts read-only); nothing secret is in the
image.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from recsys_stack.config import ConfigError, parse
from serving.torchserve import process
from serving.torchserve.config import TorchServeConfig, resolve_model


def main(argv: list[str] | None = None) -> int:
    try:
        doc = __doc__.split("\n\n")[0]
        cfg = resolve_model(parse(TorchServeConfig, argv, "python docker/torchserve_entry.py", doc))
        proc = process.start(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as e:
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
            process.stop(proc)
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
