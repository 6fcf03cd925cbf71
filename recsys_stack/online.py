"""The closed loop's records: what the gateway logs per scored example (an *impression*), what a
``Feedback`` call logs (a *click*), and the joined row the continuous loop trains on.

Written by the gateway (``serving/gateway/featurelog.py``), read by the Flink joiner
(``streaming/joiner.py``, in its own environment: this module imports the standard library
only) and by the online demo's accounting. One JSON object a line, in rolling files
``<kind>-<writer>-<seq>.jsonl`` that appear by rename when complete (a writer's open file is
hidden: ``.<name>.tmp``); ``kind`` is :data:`IMPRESSIONS` or :data:`CLICKS`.

An impression::

    {"request_id": "...", "example": 0, "event_time_ms": 1733400000123, "model": "recsys",
     "version": "3", "score": 0.0312, "row": "<39 tab-separated Criteo fields>"}

``row`` is the example exactly as served in the trainer's Criteo TSV format without the label
(:func:`criteo_row`: the raw dense values and raw ids, an empty field = missing). When it
cannot be written there (a non-integral dense value, two ids in one field) ``row`` is null and
``dense`` and ``sparse`` carry the features as served (raw dense values; raw ids per sparse
feature in schema order, ``[]`` = missing): such an impression is logged but cannot be trained
on, and the joiner counts it apart. A click::

    {"request_id": "...", "example": 0, "event_time_ms": 1733400004567, "label": 1,
     "received_ms": 1733400004601}

The joined row is ``<label>\\t<row>``: the trainer's format, so the joiner's files go straight
into the continuous loop's folder.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

IMPRESSIONS = "impressions"
CLICKS = "clicks"
SUFFIX = ".jsonl"
NUM_DENSE = 13
NUM_SPARSE = 26
IMPRESSION_FIELDS = ("request_id", "example", "event_time_ms", "model", "version", "score",
                     "dense", "sparse", "row")  # fmt: skip
CLICK_FIELDS = ("request_id", "example", "event_time_ms", "label", "received_ms")
# A call carrying this metadata (value "off") is scored as any other and not logged: rows scored
# by a tool rather than served to users (``make score``, ``make evaluate``, a rollout's gate)
# get no click, so logged they would all train as 0s
OPT_OUT_HEADER = "x-recsys-feature-log"
MAX_REQUEST_ID = 128  # characters: a request id is an opaque token, not a payload


def criteo_row(dense: Sequence[float], sparse: Sequence[Sequence[int]]) -> str | None:
    """One example's 39 Criteo fields (13 decimal integers, 26 lower-case hex ids; an empty
    field = missing), tab-separated; None when the example cannot be written so: a dense value
    that is not an integer (NaN, infinite, fractional) or a sparse field with more than one id
    (or a negative one). The inverse of how ``make score`` builds a request from a TSV row
    (dense missing -> 0, sparse missing -> no id)."""
    if len(dense) != NUM_DENSE or len(sparse) != NUM_SPARSE:
        return None
    fields = []
    for v in dense:
        f = float(v)
        if not math.isfinite(f) or f != math.floor(f):
            return None
        fields.append(str(int(f)))
    for ids in sparse:
        if len(ids) > 1 or (ids and int(ids[0]) < 0):
            return None
        fields.append(format(int(ids[0]), "x") if ids else "")
    return "\t".join(fields)


def file_name(kind: str, writer: str, seq: int) -> str:
    """A closed log file's name: natural name order is the order a writer closed them."""
    return f"{kind}-{writer}-{seq:08d}{SUFFIX}"
