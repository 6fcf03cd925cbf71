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
