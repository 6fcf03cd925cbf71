"""Run out of file descriptors on purpose: what a gateway's token file and plan reads meet when
idle connections hold every descriptor (issue 45). For the scripts tests run in a child process."""

from __future__ import annotations

import os
import resource


def exhaust(soft: int = 64) -> list[int]:
    """Lower this process's soft open-files limit to ``soft`` (the hard one kept) and open
    /dev/null until EMFILE; the descriptors held (close them to recover)."""
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    )
    held: list[int] = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        return held
