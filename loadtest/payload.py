"""Request payloads for the load generator: a working set drawn across a whole Criteo TSV -> a
pool of ``ScoreRequest``.

The working set (:func:`working_set`) is the whole file when it holds at most ``rows`` rows;
otherwise ``rows`` rows sampled across all of it: the file is cut into equal byte slices, one
per run of :data:`RUN_ROWS` consecutive rows, and each run starts at the first line after a
seeded random offset in its slice. So a 45 GB file costs ``rows / 64`` seeks and ``rows`` lines
of memory, never a read of the file, and the same ``(file, rows, seed)`` gives the same rows.

The pool (:func:`request_pool`) deals the working set out like cards: a seeded shuffle, cut into
requests of ``examples`` rows, reshuffled when used up; it holds at least enough requests for
every row to appear once. Requests are built once per load process and every call picks one at
random: the generator's CPU goes into calls, not into protobuf building.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from recsys_stack.criteo_rows import RowError
from serving.stubs import ranker_pb2
from serving.tools.client import build_request, parse_rows

RUN_ROWS = 64  # consecutive rows per seek: a few KB of one read
POOL_REQUESTS = 1024  # the pool's size when the working set needs no more


@dataclass
class WorkingSet:
    """The rows requests are drawn from (``N``: rows) and what the report says of them."""

    dense: np.ndarray  # float32[N, 13], raw
    sparse: np.ndarray  # int64[N, 26], raw ids, -1 = missing
    info: dict[str, Any]  # rows, distinct_ids, sampled, file_bytes, file_rows(_est), seed


def _run(f: Any, offset: int, n: int) -> list[tuple[int, bytes]]:
    """Up to ``n`` non-empty lines (with their byte offsets) from the first line start at or
    after ``offset`` (``f``: the file in binary mode); fewer at the end of the file."""
    f.seek(offset)
    if offset:
        f.readline()  # the rest of a line that began before the offset
    out: list[tuple[int, bytes]] = []
    while len(out) < n:
        pos, line = f.tell(), f.readline()
        if not line:
            break
        if line.strip():
            out.append((pos, line))
    return out


def sample_lines(path: Path, rows: int, seed: int = 0) -> tuple[list[tuple[int, bytes]], bool]:
    """-> ((byte offset, line) of each distinct row in file order, whether the file was sampled).

    The whole file when it has at most ``rows`` rows, else about ``rows`` rows in runs of
    :data:`RUN_ROWS` from every part of it (two runs that overlap count their rows once)."""
    with path.open("rb") as f:
        head = _run(f, 0, rows + 1)
        if len(head) <= rows:
            return head, False
        size = f.seek(0, 2)
        runs = -(-rows // RUN_ROWS)
        rng = random.Random(seed)
        seen: dict[int, bytes] = {}
        for i in range(runs):
            lo, hi = i * size // runs, (i + 1) * size // runs
            take = min(RUN_ROWS, rows - i * RUN_ROWS)
            for pos, line in _run(f, rng.randrange(lo, max(hi, lo + 1)), take):
                seen[pos] = line
    return sorted(seen.items()), True


def working_set(path: Path, rows: int = 20_000, seed: int = 0) -> WorkingSet:
    """``rows`` rows of ``path`` drawn across the whole file (see the module docstring)."""
    picked, sampled = sample_lines(path, rows, seed)
    if not picked:
        raise ValueError(f"{path}: no rows")
    try:
        parsed = parse_rows([line for _, line in picked], str(path))
    except RowError as e:  # its line is the sample's; name the file's byte offset instead
        offset = picked[e.line - 1][0]
        raise ValueError(f"{path}: the row at byte {offset:,}: {e.detail}") from None
    size = path.stat().st_size
    n = len(parsed.dense)
    info: dict[str, Any] = {"rows": n, "sampled": sampled, "seed": seed, "file_bytes": size}
    if sampled:  # from the sample's mean line length: enough to say what share it is
        info["file_rows_est"] = round(size * n / sum(len(line) for _, line in picked))
    else:
        info["file_rows"] = n
    info["distinct_ids"] = distinct_ids(parsed.sparse)
    return WorkingSet(parsed.dense, parsed.sparse, info)


def distinct_ids(sparse: np.ndarray) -> int:
    """Distinct (feature, id) pairs in ``int64[N, 26]`` raw ids (-1, missing, not counted): the
    embedding rows a server must touch to answer these rows."""
    return sum(int(np.unique(col[col >= 0]).size) for col in sparse.T)


def request_pool(
    ws: WorkingSet, examples: int, size: int = POOL_REQUESTS, seed: int = 0
) -> list[ranker_pb2.ScoreRequest]:
    """At least ``size`` requests of ``examples`` rows of ``ws`` each, and enough that every row
    of ``ws`` is in one: rows dealt from seeded shuffles (no row twice in a request)."""
    n = len(ws.dense)
    if n < examples:
        raise ValueError(f"{n} rows in the working set, fewer than --examples {examples}")
    rng = random.Random(seed)
    order: list[int] = []
    pool = []
    for _ in range(max(size, -(-n // examples))):
        if len(order) < examples:  # a fresh shuffle under the few left, without them
            left = set(order)
            deck = [i for i in range(n) if i not in left]
            rng.shuffle(deck)
            order = deck + order
        take, order = order[-examples:], order[:-examples]
        pool.append(build_request(ws.dense[take], ws.sparse[take]))
    return pool


def first_request(path: Path, examples: int) -> ranker_pb2.ScoreRequest:
    """One request of the first ``examples`` rows: a probe, without building a working set."""
    with path.open("rb") as f:
        lines = [line for _, line in _run(f, 0, examples)]
    if not lines:
        raise ValueError(f"{path}: no rows")
    rows = parse_rows(lines, str(path))
    return build_request(rows.dense, rows.sparse)
