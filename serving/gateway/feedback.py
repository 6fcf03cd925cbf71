"""``Feedback``: clicks on scored examples, over gRPC (``recsys.v1.Ranker/Feedback``) and HTTP
(``POST /v1/feedback``, JSON), written to the feature log's click files for the joiner.

A call's clicks are accepted all together or refused all together, with INVALID_ARGUMENT (HTTP
400) naming the first bad click and field: a request id that is malformed or was not issued by
this stack (its MAC, serving/gateway/request_ids.py: no table of issued ids needed), an example
index past the request's examples, a label other than 0 or 1, an event time before the request
was scored or more than :data:`MAX_FUTURE_MS` ahead of the gateway's clock, more clicks than
``feature_log.max_clicks``. With the feature log off there is nothing to join clicks with:
FAILED_PRECONDITION (HTTP 400), saying how to turn it on. A full log queue is
RESOURCE_EXHAUSTED (HTTP 429): retry. The same auth as ``Score`` (tokens of ``auth.token_file``:
the gateway's interceptor and HTTP middleware cover every method and route).

A click on a request outside the feature log's sample (``feature_log.sample``) is accepted and
not written: it has no impression to join.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import grpc

from serving.gateway.errors import ScoreError
from serving.gateway.validate import clip
from serving.stubs import ranker_pb2

if TYPE_CHECKING:
    from serving.gateway.featurelog import FeatureLog
    from serving.gateway.request_ids import RequestIds

MAX_FUTURE_MS = 60_000  # clocks of clients and gateways differ by seconds, not minutes
TURN_ON = (
    "the gateway's feature log is off, and clicks are joined with it: start the gateway with "
    "--feature-log.enabled (feature_log.enabled = true in its config; make serve "
    "SERVE_ARGS=--gateway.feature-log.enabled; docs/online.md)"
)


class Click(NamedTuple):
    """One click, whatever the protocol (the fields of ``recsys.v1.Click``)."""

    request_id: str
    example: int
    label: int
    event_time_ms: int


def _refuse(
    log: FeatureLog | None, reason: str, n: int, code: grpc.StatusCode, text: str
) -> NoReturn:
    if log is not None:
        log.clicks_refused[reason] += n
    raise ScoreError(code, text)


def accept(log: FeatureLog | None, ids: RequestIds, clicks: Sequence[Any]) -> int:
    """Check every click (``recsys.v1.Click`` or :class:`Click`), then enqueue their records
    for the click files; how many were accepted. :class:`ScoreError` refuses them all."""
    n = len(clicks)
    if log is None:
        _refuse(log, "off", n, grpc.StatusCode.FAILED_PRECONDITION, TURN_ON)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    if n > log.cfg.max_clicks:
        _refuse(log, "invalid", n, invalid, f"clicks: {n}, at most {log.cfg.max_clicks} per "
                "call (feature_log.max_clicks)")  # fmt: skip
    now = time.time_ns() // 1_000_000
    lines = []
    for k, c in enumerate(clicks):
        where = f"clicks[{k}]"
        try:
            issued = ids.check(c.request_id)
        except ValueError as e:
            _refuse(log, "invalid", n, invalid, f"{where}.request_id {clip(c.request_id)} {e}")
        if c.example >= issued.examples:
            _refuse(log, "invalid", n, invalid, f"{where}.example: {c.example}, but request "
                    f"{c.request_id} had {issued.examples} examples (0-based indices)")  # fmt: skip
        if c.label not in (0, 1):
            _refuse(log, "invalid", n, invalid, f"{where}.label: {c.label}, not 0 or 1")
        t = c.event_time_ms or now
        if t < issued.issued_ms:
            _refuse(log, "invalid", n, invalid, f"{where}.event_time_ms: {t}, before request "
                    f"{c.request_id} was scored ({issued.issued_ms})")  # fmt: skip
        if t > now + MAX_FUTURE_MS:
            _refuse(log, "invalid", n, invalid, f"{where}.event_time_ms: {t}, more than "
                    f"{MAX_FUTURE_MS // 1000} s after the gateway's clock ({now})")  # fmt: skip
        if log.sampled(c.request_id):
            record = {"request_id": c.request_id, "example": c.example, "event_time_ms": t,
                      "label": c.label, "received_ms": now}  # fmt: skip
            lines.append(json.dumps(record) + "\n")
    if lines and not log.clicks("".join(lines).encode(), len(lines)):
        _refuse(log, "queue_full", n, grpc.StatusCode.RESOURCE_EXHAUSTED,
                "the feature log's queue is full: retry in a moment")  # fmt: skip
    log.clicks_accepted += n
    return n


def response(accepted: int) -> Any:
    return ranker_pb2.FeedbackResponse(accepted=accepted)


def _int(doc: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = doc.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key}: {clip(json.dumps(value))}, not an integer")
    return value


def clicks_of(body: bytes, max_clicks: int) -> list[Click]:
    """``{"clicks": [{"request_id", "example", "label", "event_time_ms" (optional)}]}`` ->
    clicks; ValueError naming the click and field (more than ``max_clicks``: before any)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"the body is not JSON: {e}") from None
    clicks = doc.get("clicks") if isinstance(doc, dict) else None
    if not isinstance(clicks, list):
        raise ValueError('the body must be {"clicks": [{"request_id": ..., "example": ..., '
                         '"label": ..., "event_time_ms": ...}, ...]}')  # fmt: skip
    if len(clicks) > max_clicks:
        raise ValueError(f"clicks: {len(clicks)}, at most {max_clicks} per call "
                         "(feature_log.max_clicks)")  # fmt: skip
    out = []
    for k, c in enumerate(clicks):
        where = f"clicks[{k}]"
        if not isinstance(c, dict):
            raise ValueError(f"{where}: not an object")
        rid = c.get("request_id")
        if not isinstance(rid, str):
            raise ValueError(f"{where}.request_id: missing or not a string")
        example = _int(c, "example", where)
        if example < 0:
            raise ValueError(f"{where}.example: {example}, negative")
        out.append(Click(rid, example, _int(c, "label", where), _int(c, "event_time_ms", where, 0)))
    return out
