"""The compose stack in real containers: podman's Docker-compatible socket driven by Debian's
docker-compose 1.29 (../shared/ENGINES.md, docs/deploy.md), the images `make images` built.

``make compose-test`` runs this folder (``make test`` leaves it out: it needs the images). One
podman API service on a socket of the session's own, the health-check loop podman cannot run
without systemd (docker/podman_healthchecks.py), and a compose project in a folder of its own
(``--project-directory``: runs/, data/, model_store/, reports/ are the test's, not the repo's).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from recsys_stack.net import free_ports
from tests.deploy.test_compose import clean_env

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
IMAGES = ("trainer", "torchserve", "gateway", "locust")
PROMETHEUS_UPSTREAM = "docker.io/prom/prometheus:v2.42.0"
PROMETHEUS_LOCAL = "localhost/recsys-stack/prometheus:latest"
UID = 1000  # the images' user (RECSYS_UID): bind-mounted folders are made its own


def _run(cmd: list[str], timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def require_engine() -> str:
    """The Prometheus image to use; fails (never skips) naming the command that fixes it."""
    missing = [t for t in ("podman", "docker-compose") if shutil.which(t) is None]
    if missing:
        pytest.fail(f"no {' '.join(missing)}: run `make container-deps`")
    absent = [
        i for i in IMAGES if _run(["podman", "image", "exists", f"recsys-stack/{i}"]).returncode
    ]
    if absent:
        pytest.fail(f"images not built: {', '.join(absent)}: run `make images`")
    for image in (PROMETHEUS_UPSTREAM, PROMETHEUS_LOCAL):
        if _run(["podman", "image", "exists", image]).returncode == 0:
            return image
    pytest.fail("no Prometheus image: run `make images` (it builds recsys-stack/prometheus)")


@dataclass
class Project:
    """One compose project: ``compose(...)`` runs docker-compose on it."""

    name: str
    folder: Path
    env: dict[str, str]
    gateway_port: int
    http_port: int
    prometheus_port: int
    log: Path
    started: float = field(default_factory=time.monotonic)

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        cmd = ["docker-compose", "-p", self.name, "-f", str(COMPOSE_FILE),
               "--project-directory", str(self.folder), *args]  # fmt: skip
        t0 = time.monotonic()
        proc = _run(cmd, timeout=timeout, env=self.env)
        with self.log.open("a") as f:
            f.write(f"$ {' '.join(args)}  ({time.monotonic() - t0:.1f} s, rc {proc.returncode})\n")
            f.write(proc.stdout[-20000:] + proc.stderr[-20000:] + "\n")
        if check and proc.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
        return proc.stdout

    def compose_background(self, *args: str) -> subprocess.Popen[str]:
        """``docker-compose ARGS`` left running (its output appended to the log)."""
        cmd = ["docker-compose", "-p", self.name, "-f", str(COMPOSE_FILE),
               "--project-directory", str(self.folder), *args]  # fmt: skip
        with self.log.open("a") as f:
            f.write(f"$ {' '.join(args)}  (in the background)\n")
        out = self.log.open("a")
        return subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, text=True)

    def save_logs(self, out: Path) -> None:
        """Every container's log (``podman logs``) into ``out``, for a failure's post-mortem."""
        out.mkdir(exist_ok=True)
        label = f"label=com.docker.compose.project={self.name}"
        names = _run(["podman", "ps", "-a", "--filter", label, "--format", "{{.Names}}"]).stdout
        for name in names.split():
            logs = _run(["podman", "logs", "--timestamps", name])
            (out / f"{name}.log").write_text(logs.stdout + logs.stderr)

    def containers(self, service: str, all_: bool = False) -> list[dict[str, Any]]:
        """``podman inspect`` of the service's containers (running ones unless ``all_``)."""
        cmd = ["podman", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.name}",
               "--filter", f"label=com.docker.compose.service={service}"]  # fmt: skip
        ids = _run([*cmd, *(["-a"] if all_ else [])]).stdout.split()
        if not ids:
            return []
        return json.loads(_run(["podman", "inspect", *ids]).stdout)

    def healthy(self, service: str) -> list[dict[str, Any]]:
        return [c for c in self.containers(service) if health(c) == "healthy"]

    def wait_healthy(self, service: str, n: int, timeout: float) -> float:
        """Seconds until ``n`` containers of ``service`` are healthy (compose's own checks)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if len(self.healthy(service)) >= n:
                return time.monotonic() - t0
            time.sleep(1)
        states = [
            (c["Name"], c["State"]["Status"], health(c)) for c in self.containers(service, True)
        ]
        raise AssertionError(
            f"{service}: {n} healthy containers wanted after {timeout:.0f} s: {states}"
        )


def health(container: dict[str, Any]) -> str:
    state = container["State"]
    return str((state.get("Health") or state.get("Healthcheck") or {}).get("Status", ""))


def address(container: dict[str, Any]) -> str:
    """The container's address on its (one) compose network."""
    nets = container["NetworkSettings"]["Networks"]
    return str(next(iter(nets.values()))["IPAddress"])


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """podman's API service on a socket of this session's and the health-check loop; the
    environment docker-compose needs (``DOCKER_HOST``, the Prometheus image)."""
    prometheus = require_engine()
    d = tmp_path_factory.mktemp("engine")
    sock = d / "podman.sock"
    service = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{sock}"],
        stdout=(d / "podman-service.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    checks = subprocess.Popen(
        [sys.executable, str(ROOT / "docker" / "podman_healthchecks.py"), "--interval", "3"],
        stdout=(d / "healthchecks.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert service.poll() is None, (d / "podman-service.log").read_text()
            assert time.monotonic() < deadline, "podman system service made no socket in 60 s"
            time.sleep(0.2)
        yield {"DOCKER_HOST": f"unix://{sock}", "RECSYS_PROMETHEUS_IMAGE": prometheus}
    finally:
        for p in (checks, service):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def project(engine: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Project]:
    """A compose project of the tiny preset in a folder of its own; ``down -v`` after."""
    folder = tmp_path_factory.mktemp("compose")
    (folder / "docker").mkdir()
    shutil.copy(ROOT / "docker" / "prometheus.yml", folder / "docker")
    for sub in ("runs", "data", "model_store", "reports"):
        (folder / sub).mkdir()  # as root, as an operator following the docs: compose's
        # folders service hands them to the images' user (no chown here)
    gateway_port, http_port, prometheus_port, gw2_port, gw2_http = free_ports(5)
    env = clean_env()  # the compose file's own defaults, as tests/deploy reads it
    env.update(engine, PRESET="tiny", RECSYS_GATEWAY_PORT=str(gateway_port),
               RECSYS_GATEWAY_HTTP_PORT=str(http_port), PROMETHEUS_HOST_PORT=str(prometheus_port),
               GATEWAY_2_HOST_PORT=str(gw2_port), GATEWAY_2_HTTP_HOST_PORT=str(gw2_http),
               COMPOSE_HTTP_TIMEOUT="600")  # fmt: skip
    p = Project(f"recsys-ct{os.getpid()}", folder, env, gateway_port, http_port, prometheus_port,
                folder / "compose.log")  # fmt: skip
    try:
        yield p
    finally:
        p.save_logs(folder / "logs")
        p.compose("--profile", "train", "--profile", "load", "down", "-v", "--timeout", "20",
                  check=False)  # fmt: skip
        print(f"compose log: {p.log}")
