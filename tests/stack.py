"""TorchServe + the gateway on free ports, for tests: the one starter, and its fixtures.

``torchserve`` (one TorchServe) and ``stack`` (TorchServe + gateway) are module-scoped fixtures
on the tiny exported model; ``tests/serving/conftest.py`` and ``tests/loadtest/conftest.py``
register them. Tests that need another shape (two replicas, another deadline) call
:func:`torchserve_config`, :func:`start_torchserve` and :func:`start_gateway` directly. Both use
the product's own launchers (``serving.torchserve.process``, ``serving.tools.supervisor``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from recsys_stack.net import free_ports
from serving.gateway.config import ChannelConfig, GatewayConfig, MetricsConfig
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import gateway_status, health
from serving.tools.supervisor import launch_gateway
from serving.torchserve import process
from serving.torchserve.config import TorchServeConfig, on_free_ports
from serving.worker.codec import to_rows

# Java startup + worker load is ~10 s on a laptop; a 2-core CI box under load needs more.
STARTUP_TIMEOUT_S = 240
ROOT = Path(__file__).resolve().parents[1]
MODEL = {"mar_file": "dlrm-tiny-1.0.mar", "model_name": "dlrm-tiny", "model_version": "1.0"}


def torchserve_config(store: Path, workdir: Path, **overrides: Any) -> TorchServeConfig:
    """The tiny model's TorchServe (or the model ``overrides`` names) on five free ports, state
    in ``workdir``."""
    # the suite's JVM flags (tests/conftest.py), as `load` gives them to the `make` stacks
    jvm = {"jvm_args": os.environ.get("RECSYS_TS_JVM_ARGS", "")}
    settings = {**MODEL, **jvm, **overrides}
    return on_free_ports(TorchServeConfig(model_store=store, workdir=workdir, **settings))


def run_python(
    module: str, *args: str, env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` from the repository, run to its end; its output's tails
    printed (pytest shows them with a failure)."""
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def start_supervisor(
    schema: Path, env: dict[str, str], *args: str, timeout: float = 600
) -> tuple[subprocess.CompletedProcess[str], int, int]:
    """``make serve`` as a process: ``python -m serving.tools.supervisor start`` for
    ``schema``, TorchServe's five ports, the gateway's and its metrics' free ones (``args``:
    more flags, ``env``: its state folder and model store). (the run, gateway port, metrics
    port); ``run_python("serving.tools.supervisor", "stop", env=env)`` stops it."""
    p = free_ports(7)
    names = ("inference", "management", "metrics", "grpc-inference", "grpc-management")
    proc = run_python(
        "serving.tools.supervisor", "start", "--gateway.schema", str(schema), *args,
        "--gateway.port", str(p[5]), "--gateway.metrics.port", str(p[6]),
        f"--timeout-s={STARTUP_TIMEOUT_S}",
        *(a for k, v in zip(names, p[:5], strict=True) for a in (f"--torchserve.{k}-port", str(v))),
        env=env, timeout=timeout,
    )  # fmt: skip
    return proc, p[5], p[6]


def start_torchserve(cfg: TorchServeConfig) -> subprocess.Popen[bytes]:
    """Start TorchServe for ``cfg`` and wait until its worker is READY."""
    proc = process.start(cfg)
    secs = process.wait_ready(cfg, timeout=STARTUP_TIMEOUT_S, proc=proc)
    print(f"torchserve ready in {secs:.1f} s")
    return proc


def start_gateway(
    schema: Path, replicas: Sequence[TorchServeConfig], log: Path, /, **overrides: Any
) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m serving.gateway`` on a free port in front of ``replicas``; (process, target).
    (Positional: ``log=`` in ``overrides`` is the gateway's [log] section.)"""
    settings = {
        "backend": ",".join(r.grpc_inference_target for r in replicas),
        "key_file": ",".join(str(r.key_file) for r in replicas),
        **overrides,
    }
    cfg = GatewayConfig(schema=schema, port=free_ports(1)[0], **settings)
    if cfg.auth.token_file:  # private, as make serve writes it (the gateway refuses others)
        os.chmod(cfg.auth.token_file, 0o600)
    return launch_gateway(cfg, log), f"127.0.0.1:{cfg.port}"


def stop_gateway(gateway: subprocess.Popen[bytes]) -> int:
    """SIGTERM (graceful) and the exit code."""
    gateway.send_signal(signal.SIGTERM)
    return gateway.wait(timeout=30)


def wait_status(
    target: str, want: str, timeout: float, channel: ChannelConfig | None = None
) -> float:
    """Seconds until the gateway's health is ``want`` (``channel``: TLS and token, None =
    plaintext); fails the test after ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if gateway_status(target, channel=channel) == want:
            return time.monotonic() - t0
        time.sleep(0.2)
    raise AssertionError(f"gateway never became {want} (now {health(target, channel=channel)})")


def ours(workdir: Path) -> list[psutil.Process]:
    """Live processes whose command line names ``workdir`` (java -f <workdir>/config.properties)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(workdir) in " ".join(
                p.info["cmdline"] or []
            ):
                out.append(p)
        except psutil.Error:
            continue
    return out


@contextlib.contextmanager
def running_torchserve(
    store: Path, workdir: Path, **overrides: Any
) -> Iterator[tuple[TorchServeConfig, subprocess.Popen[bytes]]]:
    """TorchServe for the block; afterwards nothing of it may be left running."""
    cfg = torchserve_config(store, workdir, **overrides)
    proc = start_torchserve(cfg)
    try:
        yield cfg, proc
    finally:
        t0 = time.monotonic()
        process.stop(proc, timeout=30)
        print(f"torchserve stopped in {time.monotonic() - t0:.1f} s")
    assert not process.group_members(proc.pid)
    assert not ours(cfg.workdir.resolve()), "a java/worker process outlived stop()"


@dataclass
class Stack:
    """A running TorchServe + gateway, and the tiny export's sample rows (row-major sparse)."""

    cfg: TorchServeConfig
    torchserve: subprocess.Popen[bytes]
    gateway: subprocess.Popen[bytes]
    target: str
    stub: ranker_pb2_grpc.RankerStub
    rows: dict[str, np.ndarray]
    deadline_s: float


@contextlib.contextmanager
def running_stack(
    export: Path, store: Path, workdir: Path, deadline_s: float = 2.0, **gateway: Any
) -> Iterator[Stack]:
    """TorchServe + gateway (SERVING) for the block; the gateway must exit cleanly after.
    ``gateway``: more GatewayConfig settings (``limits=Limits(...)``)."""
    cfg = torchserve_config(store, workdir)
    torchserve = start_torchserve(cfg)
    gateway, target = start_gateway(
        export / "schema.json", [cfg], workdir / "gateway.log", deadline_s=deadline_s, **gateway
    )
    s = np.load(export / "sample.npz")
    rows = {k: s[k] for k in s.files}
    # sample.npz holds encoded inputs; rebuild the row-major arrays a client starts from.
    rows["sparse"] = to_rows(rows["values"], rows["lengths"])
    channel = grpc.insecure_channel(target)
    st = Stack(
        cfg, torchserve, gateway, target, ranker_pb2_grpc.RankerStub(channel), rows, deadline_s
    )
    try:
        wait_status(target, "SERVING", 120)
        yield st
    finally:
        channel.close()
        try:
            assert stop_gateway(gateway) == 0  # graceful shutdown exits cleanly
        finally:
            process.stop(st.torchserve)  # the outage test replaces the instance it started with
    assert not ours(workdir), "a TorchServe process outlived the test"


@pytest.fixture(scope="module")
def torchserve(
    exported: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TorchServeConfig, subprocess.Popen[bytes]]]:
    """One TorchServe on free ports serving the tiny model: batching 8 requests / 100 ms (long
    enough that concurrent requests share a batch on a loaded CI machine)."""
    _, store, _ = exported
    workdir = tmp_path_factory.mktemp("ts")
    with running_torchserve(
        store, workdir, workers=1, batch_size=8, max_batch_delay_ms=100, response_timeout_s=60
    ) as ts:
        yield ts


@pytest.fixture(scope="module")
def stack(
    exported: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """TorchServe + the gateway on free ports, SERVING the tiny model."""
    export, store, _ = exported
    with running_stack(export, store, tmp_path_factory.mktemp("gw")) as st:
        yield st


def gateway_metrics(
    port: int, timeout: float = 10.0
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The gateway's ``/metrics`` on ``port`` as {(sample name, sorted labels): value}, read once
    no call is in flight: a refused call's status reaches its client before the gateway counts
    it (serving/gateway/metrics.py), so counters read right after the calls may lag by one.
    A rendering is served for ``metrics.cache_s`` (1 s): one older than the caller's last
    calls is waited out first."""
    time.sleep(MetricsConfig().cache_s + 0.1)
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            got = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(r.read().decode())
                for s in family.samples
            }
        if (
            got.get(("recsys_gateway_in_flight_requests", ()), 0.0) == 0
            or time.monotonic() > deadline
        ):
            return got
        time.sleep(0.05)
