"""recsys_stack.net.free_ports: distinct free ports, from RECSYS_PORT_RANGE when it is set."""

from __future__ import annotations

import re
import socket

import pytest

from recsys_stack import net
from recsys_stack.net import PORT_RANGE_ENV, free_ports


def _held(lo: int, hi: int) -> list[int]:
    """The ports of ``lo..hi`` some socket on this machine listens on now."""
    held = []
    for port in range(lo, hi + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                held.append(port)
    return held


def test_ports_come_from_the_range_distinct_and_skip_taken_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(net, "_given", set())
    with socket.socket() as probe:  # a range of 12 ports, one of them listened on here
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    lo, hi = (base - 6, base + 5) if base > 40_000 else (base, base + 11)
    busy = socket.socket()
    busy.bind(("127.0.0.1", lo + 3))
    busy.listen()
    try:
        monkeypatch.setenv(PORT_RANGE_ENV, f"{lo}-{hi}")
        taken = set(_held(lo, hi))
        first = free_ports(4)
        second = free_ports(12 - 4 - len(taken))
        got = first + second
        assert len(set(got)) == len(got) and all(lo <= p <= hi for p in got)
        assert not set(got) & taken and lo + 3 in taken
        with pytest.raises(OSError, match=rf"in {PORT_RANGE_ENV}={lo}-{hi}: widen it"):
            free_ports(1)  # every port of the range handed out or held
    finally:
        busy.close()


@pytest.mark.parametrize("text", ["abc", "30000", "30000-29999", "80-90", "1024-70000"])
def test_a_malformed_range_says_what_to_give(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, text)
    with pytest.raises(ValueError, match=re.escape("give LO-HI, two ports 1024..65535")):
        free_ports(1)


def test_without_the_range_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(1024 <= p <= 65535 for p in ports)


def test_extra_replicas_take_no_port_the_stack_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """``make serve --replicas N``: the replicas past the first take free ports in the
    supervisor's process, before the gateway binds its own; a port the config names (the
    gateway's, its metrics', the first replica's) is free then and must still not be taken (a
    replica's gRPC port on the gateway's metrics port failed a rollout: HTTP/2 bytes to GET)."""
    import dataclasses
    from pathlib import Path

    from serving.gateway.config import GatewayConfig, MetricsConfig
    from serving.tools.supervisor import ServeConfig, replica_configs
    from serving.torchserve.config import TorchServeConfig

    monkeypatch.setattr(net, "_given", set())
    free = _free_block(16)
    monkeypatch.setenv(PORT_RANGE_ENV, f"{free[0]}-{free[-1]}")
    named = free[:8:2]  # spread through the range: the first replica's ports and the gateway's
    ts = dataclasses.replace(TorchServeConfig(), inference_port=named[0], management_port=named[1],
                             metrics_port=free[9], grpc_inference_port=free[11],
                             grpc_management_port=free[13], model_name="m", model_version="1")  # fmt: skip
    gw = GatewayConfig(port=named[2], metrics=MetricsConfig(port=named[3]))
    cfg = ServeConfig(workdir=Path("/tmp/unused"), replicas=2, torchserve=ts, gateway=gw)

    class Schema:
        model_name, model_version = "m", "1"

    _, other = replica_configs(cfg, Schema(), Path("/tmp/unused/plan.json"))  # type: ignore[arg-type]
    mine = {getattr(other, f"{k}_port") for k in
            ("inference", "management", "metrics", "grpc_inference", "grpc_management")}  # fmt: skip
    stack = {*named, free[9], free[11], free[13]}
    assert len(mine) == 5 and not mine & stack, (mine, stack)


def _free_block(n: int) -> list[int]:
    """``n`` consecutive ports none of which is bound now (a block found by probing)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    start = base - n - 1 if base > 40_000 else base + 1
    for lo in range(start, start + 2000):
        if not set(_held(lo, lo + n - 1)):
            return list(range(lo, lo + n))
    raise AssertionError("no free block of ports")
