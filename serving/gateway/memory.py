"""The gateway process's heap: freed memory is kept for the next request, not handed back.

glibc gives blocks over 128 KB out as fresh ``mmap`` pages and hands freed heap back to the
kernel once the top of the heap has a few hundred KB free. A 1,000-example request's buffers
(the request, the decoded ids and their temporaries, TorchServe's body: a few MB) then cost ~450
page faults every time, each page zeroed again by the kernel: ~0.6 ms of CPU per request on the
2-core machine, a third of the gateway's cost at that size (docs/bench.md). With the thresholds
raised, a request reuses the memory of the one before it. The price: the heap stays at its peak
size, less at most :data:`TRIM_BYTES` of free memory at its top.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# blocks up to this size come from the heap (glibc's own ceiling for its dynamic threshold)
MMAP_BYTES = 32 << 20
# free memory the top of the heap keeps before it is given back to the kernel
TRIM_BYTES = 128 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; False (and nothing changed)
    without glibc's ``mallopt``."""
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)
    )
