"""The Zipf load of ``make bench-scale`` (:mod:`serving.bench.scale`): its requests, the int8
table pages they touch (the working set), and the gateway method that sends them."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from serving.bench.measure import MIN_PER_CLIENT
from serving.bench.methods import Connect
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request

INT8_ROW = 16 + 8  # bytes of an int8 row at dim 16: the codes, then float32 scale and bias
PAGE = 4096


@dataclass
class Load:
    """The requests of one size's load runs and the int8 table bytes they touch."""

    requests: list[Any]
    working_set: int
    """Bytes of the int8 table pages the requests sent read (:func:`working_set`)."""


def zipf_ids(rows: list[int], cfg: Any) -> np.ndarray:
    """``int64[distinct, examples, 26]`` ids following Zipf(``cfg.zipf``), scattered over each
    table by a multiplicative hash (the hot ids are not the first rows)."""
    rng = np.random.default_rng(0)
    ranks = rng.zipf(cfg.zipf, (cfg.distinct, cfg.examples, len(rows))) - 1
    return ranks * 2654435761 % np.asarray(rows, dtype=np.int64)  # wraps: still deterministic


def sent(distinct: int, requests: int, concurrency: int) -> np.ndarray:
    """Indices of the requests a load run sends: caller ``i`` starts at ``i * distinct /
    concurrency`` (:func:`zipf_load`) and makes one warm-up call and ``run_cell``'s share."""
    per = max(MIN_PER_CLIENT, math.ceil(requests / concurrency)) + 1
    starts = np.arange(concurrency) * distinct // concurrency
    return np.unique((starts[:, None] + np.arange(per)[None, :]) % distinct)


def working_set(ids: np.ndarray, rows: list[int]) -> int:
    """Bytes of the distinct pages of the int8 tables file that ``ids [N, examples, 26]`` read
    (a row may straddle two pages: both count)."""
    offsets = np.cumsum([0, *rows[:-1]], dtype=np.int64)
    first = (ids + offsets) * INT8_ROW
    pages = np.unique(
        np.concatenate([(first // PAGE).ravel(), ((first + INT8_ROW - 1) // PAGE).ravel()])
    )
    return int(pages.size) * PAGE


def make_load(rows: list[int], cfg: Any) -> Load:
    """The ``cfg.distinct`` requests and the working set of those a run sends."""
    ids = zipf_ids(rows, cfg)
    rng = np.random.default_rng(1)
    requests = [build_request(rng.integers(0, 100, (cfg.examples, 13)).astype(np.float32), x)
                for x in ids]  # fmt: skip
    used = sent(cfg.distinct, cfg.requests, cfg.concurrency)
    return Load(requests, working_set(ids[used], rows))


def zipf_load(target: str, requests: list[Any], concurrency: int) -> Connect:
    """The gateway method of serving.bench, cycling through ``requests``: the ``i``-th caller
    from ``i / concurrency`` of the way through them (:func:`sent`)."""
    callers = itertools.count()

    def connect(_: Any) -> tuple[Any, Any]:
        channel = grpc.insecure_channel(target)
        stub = ranker_pb2_grpc.RankerStub(channel).Score
        start = next(callers) * len(requests) // concurrency
        calls = itertools.cycle(requests[start:] + requests[:start])

        def call() -> int:
            return len(stub(next(calls), timeout=60).scores)

        return call, channel.close

    return connect
