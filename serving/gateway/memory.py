"""The gateway process's heap: freed memory is kept for the next request, and handed back
once a burst of large requests is over.

glibc gives blocks over 128 KB out as fresh ``mmap`` pages and hands freed heap back to the
kernel once the top of the heap has a few hundred KB free. A 1,000-example request's buffers
(the request, the decoded ids and their temporaries, TorchServe's body: a few MB) then cost ~450
page faults every time, each page zeroed again by the kernel: ~0.6 ms of CPU per request on the
2-core machine, a third of the gateway's cost at that size (docs/bench.md). With the thresholds
raised (:func:`keep_freed_memory`), a request reuses the memory of the one before it.

The price was that the heap stayed at its peak: a burst of max-size requests left a gateway at
2.5-4x its start for ever (72 -> 720 MB seen). :class:`Reclaim` hands the free pages back
(``malloc_trim(0)``) from the health loop, off the event loop, once :data:`QUIET_S` passed with
no request of :data:`LARGE_BYTES` or more (:func:`saw` is told each REST body's and each
TorchServe body's size): steady load keeps its pages, a trim costs the next large request its
faults once, and ~45 ms of the offload thread per 250 MB handed back. ``malloc_trim`` gives back
only the top of glibc's first arena, not of the arenas it makes for other threads (the offload
thread, grpc's), so the process keeps one arena (:data:`ARENAS`): its threads mostly wait on the
GIL, not on each other's malloc.

Measured with TorchServe on the tiny model, a fresh gateway, RSS/PSS in MB: start, a burst of
48 max-size requests from 8 clients (JSON 4.07 MB, binary 3.90 MB, gRPC ``Score`` 3.18 MB),
right after, and 10 s idle (``/tmp`` harness, a 2-core machine other jobs shared)::

    variant                              start   peak  after  idle 10 s (RSS / PSS)
    glibc's defaults                        72    302    226  226 / 203
    keep_freed_memory (before)              73    356    185  185 / 158  (310 / 282 another run)
      + MALLOC_ARENA_MAX=2                  72    296    269  269 / 243
      + malloc_trim after 5 s quiet         72    299    231   98 /  72  (threads' arenas kept)
      + malloc_trim, one arena (now)        71    276    247   84 /  57

Steady load after it, per request (gateway CPU, minor page faults): max-size binary REST,
glibc's defaults 18.3 ms and 4,883 faults; keep_freed_memory 10.8 ms and 0; now 10.0 ms and 0.
1,000 examples over gRPC ``Score``: 2.5, 2.8 and 2.3 ms, 2-3 faults each (one arena costs
nothing visible). What stays after a trim is Python's own (pymalloc arenas a JSON parse left
partly used: ~25 MB after a burst of JSON bodies, none after binary or gRPC ones).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable

# blocks up to this size come from the heap (glibc's own ceiling for its dynamic threshold)
MMAP_BYTES = 32 << 20
# free memory the top of the heap keeps before it is given back to the kernel
TRIM_BYTES = 128 << 20
# a request this large leaves free heap worth handing back (a 1,000-example request with one
# id a feature is ~0.4 MB to TorchServe; max-size ones, 4 MB)
LARGE_BYTES = 1 << 20
# free pages go back this long after the last large request
QUIET_S = 5.0
# ...and when the process has grown by this much since its last trim with no large request in
# QUIET_S: 1,100 idle TLS connections took it from 86 to 203 MB and it stayed there once they
# closed, no large request coming to set off a trim (make bench-isolation, idle-conns row)
GROWTH_BYTES = 32 << 20
# glibc's arenas for this process's threads (malloc_trim gives back the top of the first only)
ARENAS = 1
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process and keep its threads in one
    arena (before they start: the gateway's first step); False without glibc's ``mallopt``."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return all(
        mallopt(param, value)
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_BYTES),
            (_M_TRIM_THRESHOLD, TRIM_BYTES),
            (_M_ARENA_MAX, ARENAS),
        )
    )


class Reclaim:
    """Hands free heap pages back to the kernel after a burst of large requests (see the
    module's docstring): :meth:`saw` each request's size, :meth:`tick` now and then."""

    def __init__(
        self,
        quiet_s: float = QUIET_S,
        large_bytes: int = LARGE_BYTES,
        clock: Callable[[], float] = time.monotonic,
        rss: Callable[[], int] | None = None,
        growth_bytes: int = GROWTH_BYTES,
    ) -> None:
        self.quiet_s, self.large_bytes, self.clock = quiet_s, large_bytes, clock
        self.rss, self.growth_bytes = rss or resident_bytes, growth_bytes
        self.base: int | None = None
        """Resident bytes after the last trim (or at the first look): growth is from here."""
        self.last_large: float | None = None
        """When the last large request not yet followed by a trim came (None: none since)."""
        self.trims = 0
        trim = getattr(_libc(), "malloc_trim", None)  # glibc only
        self._trim: Callable[[int], int] | None = trim

    def saw(self, nbytes: int) -> None:
        """A request of ``nbytes`` came in (cheap: the hot path calls it)."""
        if nbytes >= self.large_bytes:
            self.last_large = self.clock()

    def due(self) -> bool:
        """No large request for :attr:`quiet_s`, and one came since the last trim or the
        process grew by :attr:`growth_bytes` since then (connections come and go too)."""
        if self.last_large is not None:
            return self.clock() - self.last_large >= self.quiet_s
        resident = self.rss()
        if self.base is None or resident < self.base:
            self.base = resident
        return resident > self.base + self.growth_bytes

    def tick(self) -> bool:
        """Trim when :meth:`due`; True when it did (ctypes lets the GIL go meanwhile)."""
        if not self.due():
            return False
        self.last_large = None
        if self._trim is None:
            return False
        self._trim(0)
        self.trims += 1
        self.base = self.rss()
        return True


def resident_bytes() -> int:
    """This process's resident set (``/proc/self/statm``: a read, ~10 us); 0 where there is
    none (never a reason to trim)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
RECLAIM = Reclaim()
"""The process's (a heap is per process)."""


def saw(nbytes: int) -> None:
    """A request of ``nbytes`` came in: :meth:`Reclaim.saw` of :data:`RECLAIM`."""
    RECLAIM.saw(nbytes)
