"""The chaos run's cluster (two TorchServe replicas + a gateway) and the faults it injects.

Every fault acts on one component, through the product's own launchers, and returns once that
component can serve again (or ``recover_timeout_s`` passed), as an :class:`Event` with wall-clock
times that line up with the load's per-call records (``loadtest/chaos_locustfile.py``):

- ``kill-worker``: SIGKILL one worker process of a replica (PIDs from TorchServe's describe
  API); TorchServe starts a new one. Ready: a new worker is READY.
- ``kill-workers``: SIGKILL every worker of a replica at once. Ready: a new worker is READY.
- ``kill-replica``: SIGKILL the replica's whole process group (launcher, java, workers), then
  start it again with the same config (new ports: none; new keys: yes, the gateway re-reads
  them). Ready: a READY worker.
- ``pause-replica``: SIGSTOP the replica's group for ``pause_s``, then SIGCONT. Ready: SIGCONT.
- ``gateway-takeover``: start a second gateway on the same port (gRPC binds with SO_REUSEPORT on
  Linux), wait until it is SERVING, then SIGTERM the first (graceful: in-flight calls finish).
  Ready: the first has exited.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from serving.gateway.config import GatewayConfig
from serving.tools import canary
from serving.tools.supervisor import launch_gateway
from serving.torchserve import process
from serving.torchserve.config import TorchServeConfig

log = logging.getLogger("loadtest.chaos")
POLL_S = 0.1
SERVING_LINE = "gateway is SERVING"  # the gateway's log line when its health turns SERVING


@dataclass
class Replica:
    """One TorchServe instance (its own process group and work directory)."""

    name: str
    cfg: TorchServeConfig
    proc: subprocess.Popen[bytes]

    @property
    def backend(self) -> str:
        """What the gateway names it in ``x-recsys-backend``."""
        return self.cfg.grpc_inference_target


@dataclass
class Gateway:
    """One gateway process and its log."""

    name: str
    cfg: GatewayConfig
    proc: subprocess.Popen[bytes]
    log: Path
    rss: list[tuple[float, int]] = field(default_factory=list)
    """(unix time, bytes) samples while it runs."""
    counts: dict[str, float] = field(default_factory=dict)
    """Its last scrape of :data:`COUNTERS` (``/metrics``, with the RSS samples)."""
    primary_since: float = 0.0
    """When it became the gateway taking the load (unix time)."""


@dataclass
class Cluster:
    replicas: list[Replica]
    gateways: list[Gateway]
    """Every gateway started; the last one is the one serving."""
    target: str
    recover_timeout_s: float = 120.0
    pause_s: float = 5.0
    successor: Callable[[GatewayConfig], GatewayConfig] = dataclasses.replace
    """The config of the gateway taking over from one with the given config (same port)."""


@dataclass
class Event:
    """One injected fault and when its component could serve again (unix times)."""

    fault: str
    component: str
    backend: str
    at: float
    ready_at: float | None = None
    detail: str = ""
    error: str = ""


def workers(cfg: TorchServeConfig) -> list[dict[str, Any]]:
    """The model's workers as TorchServe describes them ([] while unreachable)."""
    try:
        return [w for m in process.describe(cfg) for w in m.get("workers", [])]
    except (OSError, ValueError, KeyError, RuntimeError):
        return []


def ready_pids(cfg: TorchServeConfig) -> list[int]:
    return [int(w["pid"]) for w in workers(cfg) if w.get("status") == "READY" and w.get("pid")]


def _wait(until: Callable[[], bool], timeout: float) -> float | None:
    """Poll ``until``; the unix time it first held, or None after ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if until():
            return time.time()
        time.sleep(POLL_S)
    return None


def _kill_workers(c: Cluster, r: Replica, how_many: int | None, name: str) -> Event:
    pids = ready_pids(r.cfg)
    victims = pids[:how_many] if how_many else pids
    if not victims:
        return Event(name, r.name, r.backend, time.time(), error="no READY worker to kill")
    at = time.time()
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    ev = Event(name, r.name, r.backend, at, detail=f"SIGKILL worker pid {victims}")
    ev.ready_at = _wait(lambda: bool(set(ready_pids(r.cfg)) - set(pids)), c.recover_timeout_s)
    return ev


def kill_worker(c: Cluster, r: Replica) -> Event:
    return _kill_workers(c, r, 1, "kill-worker")


def kill_workers(c: Cluster, r: Replica) -> Event:
    return _kill_workers(c, r, None, "kill-workers")


def kill_replica(c: Cluster, r: Replica) -> Event:
    """SIGKILL the group, reap it, start the same config again and wait for a READY worker."""
    at, old = time.time(), r.proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(old, signal.SIGKILL)
    r.proc.wait()
    _wait(lambda: not process.group_members(old), 10)
    r.proc = process.start(r.cfg)
    ev = Event("kill-replica", r.name, r.backend, at, detail=f"SIGKILL group {old}")
    try:
        process.wait_ready(r.cfg, c.recover_timeout_s, r.proc)
        ev.ready_at = time.time()
    except RuntimeError as e:
        ev.error = str(e).splitlines()[0]
    ev.detail += f", restarted as {r.proc.pid}"
    return ev


def pause_replica(c: Cluster, r: Replica) -> Event:
    at = time.time()
    os.killpg(r.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(c.pause_s)
    finally:
        os.killpg(r.proc.pid, signal.SIGCONT)
    ev = Event("pause-replica", r.name, r.backend, at, detail=f"SIGSTOP {c.pause_s:g} s")
    ev.ready_at = time.time()
    return ev


def start_gateway(cfg: GatewayConfig, workdir: Path, name: str, timeout: float) -> Gateway:
    """A gateway for ``cfg``; returns once its log says SERVING (raises otherwise)."""
    gw_log = workdir / f"gateway-{name}.log"
    gw = Gateway(name, cfg, launch_gateway(cfg, gw_log), gw_log)
    if _wait(lambda: serving(gw), timeout) is None:
        tail = gw_log.read_text(errors="replace")[-1500:] if gw_log.exists() else "(no log)"
        with contextlib.suppress(ProcessLookupError):
            gw.proc.kill()
        raise RuntimeError(f"gateway {name} was not SERVING after {timeout:.0f} s:\n{tail}")
    return gw


def serving(gw: Gateway) -> bool:
    """Its own log says SERVING (two gateways share the port, so a health call could reach
    either); False once it has exited."""
    if gw.proc.poll() is not None:
        raise RuntimeError(f"gateway {gw.name} exited with {gw.proc.returncode}")
    return gw.log.exists() and SERVING_LINE in gw.log.read_text(errors="replace")


def gateway_takeover(c: Cluster, r: Replica | None = None) -> Event:
    """A second gateway on the same port takes over; the first gets SIGTERM."""
    old = c.gateways[-1]
    name = chr(ord(old.name) + 1)
    new = start_gateway(c.successor(old.cfg), old.log.parent, name, c.recover_timeout_s)
    c.gateways.append(new)
    at = new.primary_since = time.time()
    old.proc.send_signal(signal.SIGTERM)
    ev = Event("gateway-takeover", f"gateway {old.name}", "", at, detail=f"-> gateway {name}")
    try:
        code = old.proc.wait(timeout=old.cfg.grace_s + 30)
        ev.ready_at = time.time()
        ev.detail += f", {old.name} exited {code}"
        if code != 0:
            ev.error = f"gateway {old.name} exited with {code} after SIGTERM"
    except subprocess.TimeoutExpired:
        ev.error = f"gateway {old.name} still running {old.cfg.grace_s + 30:g} s after SIGTERM"
    return ev


FAULTS: dict[str, Callable[[Cluster, Replica], Event]] = {
    "kill-worker": kill_worker,
    "kill-workers": kill_workers,
    "kill-replica": kill_replica,
    "pause-replica": pause_replica,
    "gateway-takeover": gateway_takeover,
}


# the gateway's Prometheus series the report counts: TorchServe calls made (scoring, not
# probes) and the hedges among them (serving/gateway/hedge.py)
COUNTERS = {
    "backend_calls": "recsys_gateway_backend_call_examples_count",
    "hedges": "recsys_gateway_backend_hedges_total",
}


def scrape_counts(text: str) -> dict[str, float]:
    """:data:`COUNTERS` summed over their labels, from Prometheus' text format."""
    return {key: sum(v for _, v in canary.samples(text, name)) for key, name in COUNTERS.items()}


def sample_rss(c: Cluster) -> None:
    """One RSS sample of every live gateway, and its counters."""
    now = time.time()
    for gw in c.gateways:
        if gw.proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                gw.rss.append((now, psutil.Process(gw.proc.pid).memory_info().rss))
            text = canary.scrape(f"http://127.0.0.1:{gw.cfg.metrics.port}/metrics", timeout=0.5)
            with contextlib.suppress(ValueError):  # a text cut short: the next sample reads it
                gw.counts = scrape_counts(text) if text else gw.counts


def stop_all(c: Cluster) -> None:
    """Gateways first (SIGTERM, then SIGKILL), then every replica's group; nothing left over."""
    for gw in c.gateways:
        if gw.proc.poll() is None:
            gw.proc.send_signal(signal.SIGTERM)
            try:
                gw.proc.wait(timeout=gw.cfg.grace_s + 15)
            except subprocess.TimeoutExpired:
                gw.proc.kill()
                gw.proc.wait()
    for r in c.replicas:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(r.proc.pid, signal.SIGCONT)  # a paused group cannot act on SIGTERM
        process.stop(r.proc)
