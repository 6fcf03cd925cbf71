"""Run the containers' HEALTHCHECKs where podman cannot schedule them (no systemd).

Podman runs each container's health check from a systemd timer; on a host without systemd (a
container-in-container CI, this project's gVisor machines) no check ever runs, health stays
``starting`` and ``depends_on: condition: service_healthy`` waits forever. This loop is that
timer: every ``--interval`` seconds it runs ``podman healthcheck run`` (the image's own check:
same command, timeout and retries, the status compose reads) for every running container that
has one, optionally only those with ``--label``. Standard library only; stop it with SIGTERM.

    python docker/podman_healthchecks.py --label com.docker.compose.project=recsys &
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

STATES = ("starting", "healthy", "unhealthy")  # containers with a check (not "none")


def with_checks(label: str) -> list[str]:
    """IDs of the running containers that have a health check (with ``label``, if given)."""
    ids: set[str] = set()
    for state in STATES:
        cmd = ["podman", "ps", "-q", "--filter", f"health={state}"]
        cmd += ["--filter", f"label={label}"] if label else []
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        ids.update(out.stdout.split())
    return sorted(ids)


def check(container: str) -> None:
    # exit 1 = unhealthy (recorded by podman itself); a container gone meanwhile fails too
    subprocess.run(["podman", "healthcheck", "run", container], capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interval", type=float, default=5.0, help="seconds between rounds (5)")
    p.add_argument("--label", default="", help="only containers with this label (key=value)")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error("--interval must be > 0")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with ThreadPoolExecutor(8) as pool:
        while not stop.is_set():
            try:
                list(pool.map(check, with_checks(args.label)))
            except (OSError, subprocess.SubprocessError) as e:
                print(f"podman_healthchecks: {e}", file=sys.stderr, flush=True)
            stop.wait(args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
