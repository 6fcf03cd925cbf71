"""Replicas found by name (serving/gateway/discovery.py): ``dns:///name:port`` entries, key file
templates, and the pool following what the name resolves to (join, drain, close)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest

from recsys_stack.net import free_ports
from serving.gateway import metrics
from serving.gateway.backends import BackendPool
from serving.gateway.config import GatewayConfig
from serving.gateway.discovery import Discovery, parse
from serving.gateway.errors import BackendError
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request
from serving.torchserve.config import TorchServeConfig
from serving.worker.codec import to_rows
from tests.stack import start_gateway, stop_gateway, wait_status

ROOT = Path(__file__).resolve().parents[2]


def test_entries_parse_in_the_grpc_naming_forms() -> None:
    got = [(e.host, e.port, e.dns) for e in parse("a:1, dns:///ts:7071,dns:ts2,[::1]:9")]
    assert got == [("a", 1, False), ("ts", 7071, True), ("ts2", 7070, True), ("::1", 9, False)]
    lite = Discovery("lite:/run/l/7200.sock,lite:/run/l/7201.sock", "/k/7200.json,/k/7201.json")
    assert lite.fixed() == [("lite:/run/l/7200.sock", Path("/k/7200.json")),
                            ("lite:/run/l/7201.sock", Path("/k/7201.json"))]  # fmt: skip
    for bad, says in [
        ("", "no TorchServe address"),
        ("a", "needs a port"),
        ("a:0", "needs a port"),
        ("a:x", "needs a port"),
        ("dns://8.8.8.8/ts:7070", "no DNS authority"),
        ("dns:///:7070", "names no host"),
        ("lite:", "needs a socket path"),
        ("lite:/" + "d" * 120 + "/w.sock", "Unix sockets take 107 at most"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse(bad)


def test_key_files_one_per_entry_or_a_template(tmp_path: Path) -> None:
    d = Discovery("a:1,b:2", "ka.json,kb.json")
    assert d.fixed() == [("a:1", Path("ka.json")), ("b:2", Path("kb.json"))]
    d = Discovery("a:1,dns:///ts:7070", f"{tmp_path}/{{host}}-{{port}}.json")
    assert d.fixed() == [("a:1", tmp_path / "a-1.json")] and d.dynamic
    with pytest.raises(ValueError, match="3 key files for 2 backend entries"):
        Discovery("a:1,b:2", "k1,k2,k3")
    with pytest.raises(ValueError, match=r"template .* is the only key file"):
        Discovery("a:1,b:2", "/keys/{host}.json,k2")
    with pytest.raises(ValueError, match="needs a port"):  # the config says it at load
        GatewayConfig(backend="dns:///ts:http")


def test_a_name_resolves_to_its_addresses_and_keeps_them_through_a_failure() -> None:
    async def run() -> None:
        d = Discovery("dns:///localhost:7070,dns:///no-such-replica.invalid:7070", "{host}.json")
        found = await d.resolve()
        assert ("127.0.0.1:7070", Path("127.0.0.1.json")) in found
        assert all(not t.startswith("no-such") for t, _ in found)  # nothing known: none
        d.entries[0] = d.entries[1].__class__("x", "no-such-replica.invalid", 7070, True)
        assert ("127.0.0.1:7070", Path("127.0.0.1.json")) in await d.resolve()  # kept

    asyncio.run(run())


def test_the_pool_follows_the_replicas_joining_draining_and_closing() -> None:
    async def run() -> None:
        m = metrics.configure(10, 10)
        pool = BackendPool("dns:///no-such-replica.invalid:7070", "k.json", "m", 2.0)
        assert pool.backends == []
        with pytest.raises(BackendError, match="no TorchServe replica: dns:///no-such"):
            await pool.predict(b"", "1", 1.0)
        pool.join([("127.0.0.1:1", Path("k1")), ("127.0.0.1:2", Path("k2"))])
        assert [b.target for b in pool.backends] == ["127.0.0.1:1", "127.0.0.1:2"]
        assert b'backend="127.0.0.1:2"' in generate_latest(m.registry)
        busy = pool.backends[1]
        busy.in_flight = 1  # a call still running on the replica that leaves
        pool.join([("127.0.0.1:1", Path("k1")), ("127.0.0.1:3", Path("k3"))])
        assert [b.target for b in pool.backends] == ["127.0.0.1:1", "127.0.0.1:3"]
        assert b'backend="127.0.0.1:2"' not in generate_latest(m.registry)
        await pool.close_drained()
        assert busy.channel.get_state() != grpc.ChannelConnectivity.SHUTDOWN  # still draining
        busy.in_flight = 0
        await pool.close_drained()
        with pytest.raises(Exception, match="closed"):  # closed once its call ended
            await busy.channel.unary_unary("/x/y")(b"", timeout=1)
        await pool.close()

    asyncio.run(run())


def test_a_gateway_scores_through_replicas_found_by_name(
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
    exported: tuple[Path, Path, str],
    tmp_path: Path,
) -> None:
    """``dns:///localhost:<port>`` with a ``{host}`` key template: the address found names the
    key file, the gateway serves through it and says which replica answered."""
    cfg, _ = torchserve
    export, _, _ = exported
    port = cfg.grpc_inference_target.rsplit(":", 1)[1]
    os.symlink(cfg.key_file.resolve(), tmp_path / "127.0.0.1.json")
    gateway, target = start_gateway(
        export / "schema.json", [cfg], tmp_path / "gateway.log",
        backend=f"dns:///localhost:{port}", key_file=f"{tmp_path}/{{host}}.json",
    )  # fmt: skip
    try:
        wait_status(target, "SERVING", 120)
        s = np.load(export / "sample.npz")
        req = build_request(s["dense"][:2], to_rows(s["values"], s["lengths"])[:2])
        with grpc.insecure_channel(target) as ch:
            reply, call = ranker_pb2_grpc.RankerStub(ch).Score.with_call(req, timeout=30)
        assert len(reply.scores) == 2
        assert ("x-recsys-backend", f"127.0.0.1:{port}") in call.trailing_metadata()
    finally:
        assert stop_gateway(gateway) == 0
    assert f"backend 127.0.0.1:{port} added" in (tmp_path / "gateway.log").read_text()


def test_the_container_healthcheck_wants_a_ready_worker(
    torchserve: tuple[TorchServeConfig, subprocess.Popen[bytes]],
) -> None:
    """``docker/healthcheck.py torchserve`` (compose's and the k8s readiness probe) passes on a
    replica with a READY worker, found from the variables the container sets, and fails on one
    that does not answer."""
    cfg, _ = torchserve
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECSYS_")}
    env.update(RECSYS_TS_MANAGEMENT_PORT=str(cfg.management_port),
               RECSYS_TS_WORKDIR=str(cfg.workdir), RECSYS_MODEL_STORE=str(cfg.model_store))  # fmt: skip
    check = [sys.executable, "docker/healthcheck.py", "torchserve"]
    deadline = time.monotonic() + 60  # a busy machine's management API may answer late
    while True:  # (seen once in a parallel run beside a hog: exit 1 while the worker served)
        ok = subprocess.run(check, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        if ok.returncode == 0 or time.monotonic() > deadline:
            break
        print("healthcheck not yet:", ok.stderr.strip())
        time.sleep(1)
    assert ok.returncode == 0, ok.stderr
    env["RECSYS_TS_MANAGEMENT_PORT"] = str(free_ports(1)[0])  # nothing listens there
    down = subprocess.run(check, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert down.returncode == 1, down.stderr
