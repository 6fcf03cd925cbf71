"""When the gateway hands freed memory back (serving/gateway/memory.py), in process; the real
gateway after a burst: tests/serving/test_rest_bodies.py."""

from __future__ import annotations

import os

import pytest

from serving.gateway import memory


def test_memory_goes_back_once_a_burst_is_over(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    trims: list[int] = []
    reclaim = memory.Reclaim(quiet_s=5.0, large_bytes=1000, clock=lambda: now[0])
    monkeypatch.setattr(reclaim, "_trim", lambda pad: trims.append(pad) or 1)
    reclaim.saw(999)  # small requests never cause a trim
    now[0] += 60
    assert not reclaim.due() and not reclaim.tick()
    for _ in range(3):  # a burst, the last one at 160 s
        reclaim.saw(1000)
        now[0] += 0.1
    now[0] = 164.9
    assert not reclaim.tick(), "not quiet long enough"
    now[0] = 165.3
    assert reclaim.due() and reclaim.tick() and trims == [0]
    now[0] += 60
    assert not reclaim.tick() and trims == [0], "one trim per burst"


def test_malloc_trim_is_there() -> None:
    """glibc (the images and CI are Debian): the process's trim is real."""
    if os.uname().sysname != "Linux":
        pytest.skip("glibc only")
    reclaim = memory.Reclaim(quiet_s=0.0, large_bytes=1)
    reclaim.saw(1)
    assert reclaim.tick() and reclaim.trims == 1


def test_memory_goes_back_after_growth_without_a_large_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1,100 idle TLS connections took the gateway from 86 to 203 MB, and it stayed there once
    they closed: no large request came to set off a trim. Growth of 32 MB since the last trim
    does now; the size after a trim is the new base (no trim per health round)."""
    now, rss = [100.0], [80 << 20]
    trims: list[int] = []
    reclaim = memory.Reclaim(quiet_s=5.0, large_bytes=1000, clock=lambda: now[0],
                             rss=lambda: rss[0])  # fmt: skip

    def trim(pad: int) -> int:
        trims.append(pad)
        rss[0] = 90 << 20  # what the trim gave back
        return 1

    monkeypatch.setattr(reclaim, "_trim", trim)
    assert not reclaim.tick()  # the first look sets the base
    rss[0] = 110 << 20  # +30 MB: under the growth that calls for a trim
    assert not reclaim.tick()
    rss[0] = 200 << 20
    assert reclaim.tick() and trims == [0] and reclaim.base == 90 << 20
    assert not reclaim.tick() and trims == [0]  # from the new base: nothing grew
    reclaim.saw(1000)  # a burst under way: no trim before it is quiet, whatever the size
    rss[0] = 300 << 20
    assert not reclaim.tick()
