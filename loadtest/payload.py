"""Request payloads for the load generator: Criteo TSV rows -> a pool of ``ScoreRequest``.

Requests are built once per load process, each at a random row offset into the first
``max_rows`` rows of the file, and every call picks one of them at random: the generator's CPU
then goes into calls, not into protobuf building, which keeps its own ceiling high.
"""

from __future__ import annotations

import random
from pathlib import Path

from serving.stubs import ranker_pb2
from serving.tools.client import build_request, parse_rows


def read_rows(path: Path, max_rows: int) -> list[str]:
    """The first ``max_rows`` lines of a Criteo TSV (the file can be gigabytes)."""
    with path.open() as f:
        lines = [line for _, line in zip(range(max_rows), f, strict=False)]
    if not lines:
        raise ValueError(f"{path}: no rows")
    return lines


def request_pool(
    path: Path, examples: int, size: int = 1024, max_rows: int = 20_000, seed: int = 0
) -> list[ranker_pb2.ScoreRequest]:
    """``size`` requests of ``examples`` consecutive rows each, at random offsets into ``path``."""
    rows = parse_rows(read_rows(path, max(max_rows, examples)), str(path))
    n = len(rows.dense)
    if n < examples:
        raise ValueError(f"{path}: {n} rows, fewer than --examples {examples}")
    rng = random.Random(seed)
    pool = []
    for _ in range(size):
        lo = rng.randrange(n - examples + 1)
        pool.append(build_request(rows.dense[lo : lo + examples], rows.sparse[lo : lo + examples]))
    return pool
