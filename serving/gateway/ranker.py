"""The gateway's scoring path: ``recsys.v1.Ranker/Score`` -> validate -> admission ->
coalescer -> TorchServe gRPC ``Predictions``, and the same path behind KServe v2
(``score_arrays``; :class:`serving.gateway.service.Scorer`).

Errors carry honest codes: INVALID_ARGUMENT for a bad request (the message names the field and
example), UNAVAILABLE when TorchServe or its workers are down, DEADLINE_EXCEEDED when it is too
slow, RESOURCE_EXHAUSTED for overload, INTERNAL only for what can only be a bug.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
import numpy as np

from recsys_stack.online import OPT_OUT_HEADER
from serving.gateway import feedback, metrics, tenants
from serving.gateway.admission import Admission
from serving.gateway.backends import BackendPool
from serving.gateway.coalesce import Arrays, Coalescer, Expired, ScoreCountError
from serving.gateway.config import CoalesceConfig, GatewayConfig
from serving.gateway.errors import BackendError, ScoreError
from serving.gateway.featurelog import FeatureLog, request_ids
from serving.gateway.replica import Backend
from serving.gateway.validate import InvalidRequest, Schema, clip
from serving.gateway.wire import decode_score_request, peek_examples, score_response
from serving.plan import Plan, ordered
from serving.stubs import ranker_pb2_grpc
from serving.worker.codec import HEADER, CodecError, body_bytes, decode_response, encode_request

logger = logging.getLogger("serving.gateway")
SERVICE = "recsys.v1.Ranker"
# room for what a PredictionsRequest carries beside the body (model name, version, framing)
ENVELOPE_BYTES = 4096
# requests larger than this are decoded in a thread, off the event loop (health checks and
# small requests keep flowing while a megabyte request is decoded); TorchServe bodies larger
# than ENCODE_OFFLOAD_BYTES are written there too (a smaller one is one copy, on the loop)
OFFLOAD_BYTES = 256 * 1024
ENCODE_OFFLOAD_BYTES = 1 << 20
# workers of a replica whose handler has not counted them (an older .mar): TorchServe starts one
# per core, and the smallest machine this stack runs on has 2
ASSUMED_WORKERS = 2


def opted_out(metadata: Iterable[tuple[str, Any]] | None) -> bool:
    """Whether the call asked not to be logged (``x-recsys-feature-log: off``): gRPC metadata
    or HTTP headers (their names in any case)."""
    return any(k.lower() == OPT_OUT_HEADER and v == "off" for k, v in metadata or ())


def call_slots(c: CoalesceConfig, backends: Sequence[Backend]) -> int:
    """Backend calls in flight at most per version: ``c.calls_per_worker`` per worker of the
    replicas in rotation (of all while none is; a replica that has not said counts
    :data:`ASSUMED_WORKERS`), or ``c.calls_per_backend`` per replica when set; counted as one
    replica while none is known (names not resolved yet)."""
    if c.calls_per_backend:
        return c.calls_per_backend * max(1, len(backends))
    serving = [b for b in backends if b.healthy] or backends
    return c.calls_per_worker * (
        sum(b.workers or ASSUMED_WORKERS for b in serving) or ASSUMED_WORKERS
    )


class Ranker(ranker_pb2_grpc.RankerServicer):  # type: ignore[misc]
    def __init__(self, cfg: GatewayConfig, schema: Schema, pool: BackendPool, plan: Plan) -> None:
        self.cfg = cfg
        self.schema = schema  # the request contract, shared by every version of the plan
        self.pool = pool
        self.plan = plan
        self.slots = call_slots(cfg.coalesce, pool.backends)
        self._slots_said: dict[str, int | str] | None = None  # the workers last logged
        self.body_limit = cfg.backend_max_bytes - ENVELOPE_BYTES - HEADER.size
        self.coalescers: dict[str, Coalescer] = {}  # per version: a merged call is one version
        self.ids = request_ids(cfg.feature_log)  # KeyFileError when the key is unusable
        self.feature_log: FeatureLog | None = None  # set by the server when feature_log.enabled
        lim = cfg.limits
        self.admission = Admission(
            lim.max_inflight_examples,
            lim.max_inflight_ids,
            hold_s=lim.door_hold_s,
            read_timeout_s=lim.read_timeout_s,
            queue_cost=lim.tenant_queue_share,
            queue_calls=lim.tenant_queue_calls,
        )

    @property
    def in_flight(self) -> int:
        """Backend calls in flight through the coalescers."""
        return sum(c.in_flight for c in self.coalescers.values())

    def retune_slots(self) -> None:
        """Follow the replicas' workers (after each health round): a larger count lets queued
        requests leave at once."""
        slots = call_slots(self.cfg.coalesce, self.pool.backends)
        deck = self.deck(slots)
        workers = {b.target: b.workers or "?" for b in self.pool.backends}
        if slots != self.slots or workers != self._slots_said:  # said again when they change
            logger.info(
                "backend calls in flight: at most %d per version, +%d merged waiting (workers %s)",
                slots, deck, workers,
            )  # fmt: skip
            self.slots, self._slots_said = slots, workers
            for c in self.coalescers.values():
                c.slots, c.deck = slots, deck
                c.dispatch()
        metrics.call_slots(slots + deck)

    def deck(self, slots: int) -> int:
        """Merged calls allowed to wait in TorchServe's queues beyond ``slots``: one per slot
        (``coalesce.merged_on_deck``), else none."""
        return slots if self.cfg.coalesce.merged_on_deck else 0

    def set_plan(self, plan: Plan) -> None:
        """Serve ``plan`` from the next call on (calls already routed finish where they are)."""
        self.plan = plan
        self.pool.cordoned = frozenset(plan.cordon)
        for gone in set(self.coalescers) - set(plan.versions):
            del self.coalescers[gone]  # its calls in flight still complete: they hold it

    def resolve(self, version: str) -> str:
        """The version a call is for: the one it names, or one drawn by the plan's traffic
        shares among the versions in rotation; NOT_FOUND for a version not in the plan."""
        plan = self.plan
        if not version:
            return plan.choose(self.pool.ready)
        if version not in plan.versions:
            raise ScoreError(
                grpc.StatusCode.NOT_FOUND,
                f"model_version {clip(version)} is not served here ({plan.model} versions: "
                f"{', '.join(ordered(plan))})",
            )
        return version

    def _coalescer(self, version: str) -> Coalescer:
        c = self.coalescers.get(version)
        if c is None:
            send = functools.partial(self._send, version)
            c = self.coalescers[version] = Coalescer(
                send,
                self.slots,
                self.cfg.coalesce.max_examples,
                self.body_limit,
                self.cfg.coalesce.alone_examples,
                self.deck(self.slots),
            )
        return c

    async def _send(
        self, version: str, arrays: Arrays, time_remaining: float | None
    ) -> tuple[np.ndarray, str]:
        """One TorchServe call for (possibly merged) validated arrays -> scores f32[B]; the one
        place that checks a reply has a score per example (both paths go through here)."""
        dense, values, lengths = arrays
        size = body_bytes(dense.shape[0], dense.shape[1], lengths.shape[0], values.size)
        envelope = self.pool.envelope(version, size)  # body written straight into the request
        if size > ENCODE_OFFLOAD_BYTES:  # megabytes of ids: copied off the event loop
            request = await asyncio.to_thread(encode_request, *arrays, envelope)
        else:
            request = encode_request(*arrays, envelope)
        started = time.monotonic()
        try:
            prediction, backend = await self.pool.predict(request, version, time_remaining)
        finally:  # failures and timeouts teach the estimate too (a stall must show in it)
            self.admission.observe(time.monotonic() - started)
        scores = decode_response(prediction)
        if scores.size != arrays[0].shape[0]:
            raise ScoreCountError(f"{scores.size} scores for {arrays[0].shape[0]} examples")
        return scores, backend

    def logs(self, metadata: Iterable[tuple[str, Any]] | None) -> bool:
        """Whether a call with this metadata (or these HTTP headers) goes to the feature log:
        the log is on and the call did not opt out. Every door asks this before scoring."""
        return self.feature_log is not None and not opted_out(metadata)

    async def score_arrays(
        self, arrays: Arrays, version: str, time_remaining: float | None, log: bool = True
    ) -> tuple[np.ndarray, str, str, str]:
        """Validated arrays -> (scores f32[B], backend, version that scored them, request
        id): the one scoring path behind every API (``recsys.v1`` and KServe v2); ``version``
        "" = the plan's choice. Raises :class:`ScoreError` with the call's status code. The
        id is issued here and the examples go to the feature log (when on) from here: every
        front door logs alike; ``log`` False: not this call (it opted out, :data:`OPT_OUT_HEADER`)."""
        version = self.resolve(version)
        examples = int(arrays[0].shape[0])
        metrics.examples(examples)
        ids = int(arrays[1].size)
        # ScoreError: refused at once, or after waiting for the tenant's share
        await self.admission.admit(examples, time_remaining, ids)
        error: ScoreError | None = None  # the version's failure: counted by status code
        try:
            if self.cfg.coalesce.enabled:
                scores, backend = await self._coalescer(version).score(arrays, time_remaining)
            else:
                metrics.backend_call(1, examples)
                scores, backend = await self._send(version, arrays, time_remaining)
        except BackendError as e:
            error = ScoreError(e.code, e.message)
        except Expired as e:
            error = ScoreError(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        except CodecError as e:  # includes the handler refusing a request: e.g. its model raised
            error = ScoreError(grpc.StatusCode.INTERNAL, f"TorchServe's reply does not decode: {e}")
        except ScoreCountError as e:
            error = ScoreError(grpc.StatusCode.INTERNAL, f"TorchServe returned {e}")
        finally:
            self.admission.release(examples, ids)
        if error is not None:
            metrics.failed(version, error.code)
            raise error
        metrics.scored(version, scores)
        ms = time.time_ns() // 1_000_000
        request_id = self.ids.issue(examples, ms)
        if log and self.feature_log is not None:  # references enqueued: formatted by its thread
            self.feature_log.scored(request_id, arrays, version, scores, ms)
        return scores, backend, version, request_id

    async def Score(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """``recsys.v1.Ranker/Score``: bytes in, bytes out (registered raw): an overload is
        refused before decoding, and neither the request nor the response goes through
        protobuf's per-value objects (``serving.gateway.wire``)."""
        try:
            # refused before the work of decoding when num_examples alone says so
            claimed = min(peek_examples(data), self.cfg.limits.max_examples)  # more: invalid
            self.admission.check(claimed, context.time_remaining())
        except ScoreError as e:  # counted by the admission rule that refused it
            if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                await self.admission.pace(tenants.current())
            await context.abort(e.code, e.message)
        try:
            if len(data) > OFFLOAD_BYTES:  # numpy releases the GIL: the loop serves others
                decoded = await asyncio.to_thread(
                    decode_score_request, data, self.schema, self.cfg.limits
                )
            else:
                decoded = decode_score_request(data, self.schema, self.cfg.limits)
            arrays, version = decoded
        except InvalidRequest as e:
            metrics.rejected("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            scores, backend, version, request_id = await self.score_arrays(
                arrays, version, context.time_remaining(), self.logs(context.invocation_metadata())
            )
        except ScoreError as e:
            await context.abort(e.code, e.message)
        # trailing, not initial: it leaves with the status in the answer's one batch (initial
        # metadata of our own would be a batch, a sendmsg and its wake-ups more per call)
        context.set_trailing_metadata(self.pool.call_metadata(backend, version))
        return score_response(scores, self.plan.model, version, request_id)

    async def Feedback(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """``recsys.v1.Ranker/Feedback``: clicks on scored examples, all or none
        (serving/gateway/feedback.py)."""
        try:
            accepted = feedback.accept(self.feature_log, self.ids, request.clicks)
        except ScoreError as e:
            await context.abort(e.code, e.message)
        return feedback.response(accepted)
