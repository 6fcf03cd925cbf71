"""KServe v2 over HTTP/JSON on the gateway (``http_port``, default 8000), beside gRPC.

The REST form of the Open Inference Protocol, as Triton and KServe serve it, on the same event
loop as the gRPC server and answered by the same :class:`serving.gateway.kserve.Model`
(metadata, readiness, tensor decoding, scoring), so ``curl``, HTTP-only probes and load
balancers, and ``tritonclient.http`` reach the model:

* ``GET /v2/health/live``, ``GET /v2/health/ready`` (200, or 503 while the gateway's health is
  NOT_SERVING: a load balancer drains it); open without a token unless ``auth.protect_health``
* ``GET /v2`` (server metadata), ``GET /v2/models/{name}[/versions/{v}]`` (model metadata),
  ``GET /v2/models/{name}[/versions/{v}]/ready``
* ``POST /v2/models/{name}[/versions/{v}]/infer``: tensors as JSON ``data`` (flat or nested,
  row-major) or in Triton's binary tensor extension (the JSON header's length in
  ``Inference-Header-Content-Length``, each input's bytes sized by its ``binary_data_size``
  parameter, in input order); scores come back as JSON, or binary when the request's
  ``binary_data_output`` parameter or the output's ``binary_data`` parameter asks. A
  ``timeout`` parameter (microseconds, as Triton's) is the call's deadline.

Same rules as gRPC: bearer tokens of ``auth.token_file`` (``Authorization: Bearer <token>``),
TLS and mutual TLS of ``tls``, the admission door and budgets, ``limits`` (a body over
``limits.max_request_bytes`` is refused with 413 from its Content-Length, before it is read;
one not received within ``limits.read_timeout_s`` ends with 408, and a connection that has not
sent a whole request head, or idles, that long is closed) and metrics: ``requests_total`` and
``request_seconds`` with ``method`` = ``"<HTTP method> <route>"`` (e.g. ``POST
/v2/models/{name}/infer``) and ``code`` = the gRPC status name the same outcome has over gRPC
(OK, INVALID_ARGUMENT, UNAUTHENTICATED, ...). Errors are ``{"error": "<one line>"}`` with
400 (bad input), 401 (no or a wrong token), 404 (unknown model, version or path), 408, 413,
429 (overloaded), 503 (no backend), 504 (deadline).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import hdrs, web

from serving.gateway import feedback, memory, metrics, tenants
from serving.gateway.auth import UNUSABLE, AuthInterceptor, bearer_token
from serving.gateway.errors import ScoreError
from serving.gateway.kserve import OUTPUT, SCORES, Model, Scored, reply_id
from serving.gateway.kserve_json import (
    DECODES,
    HEADER_LENGTH,
    QUEUED_BODIES,
    Infer,
    decoded,
    json_bytes,
)
from serving.gateway.ranker import OFFLOAD_BYTES
from serving.gateway.validate import InvalidRequest, clip

if TYPE_CHECKING:
    from serving.gateway.admission import Admission
    from serving.gateway.config import GatewayConfig, TlsConfig
    from serving.gateway.rpc import HandlerInterceptor

logger = logging.getLogger("serving.gateway.rest")
OPEN = ("/v2/health/live", "/v2/health/ready")  # no token needed unless auth.protect_health
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,  # as google.rpc's HTTP mapping has it
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class HttpError(Exception):
    """An answer ``{"error": message}`` with HTTP ``status``, counted as gRPC ``code``."""

    def __init__(self, status: int, code: grpc.StatusCode, message: str, **headers: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers

    @classmethod
    def of(cls, e: ScoreError) -> HttpError:
        status = STATUS.get(e.code, 500)
        retry = {"Retry-After": "1"} if status in (429, 503) else {}
        return cls(status, e.code, e.message, **retry)


def _json(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=json.dumps(doc).encode(), status=status, content_type="application/json",
        headers=headers,
    )  # fmt: skip


class Rest:
    """The ``/v2`` routes over ``model``, with the gateway's auth, admission and metrics."""

    def __init__(
        self,
        model: Model,
        admission: Admission,
        auth_gate: Sequence[HandlerInterceptor] = (),
        m: metrics.GatewayMetrics | None = None,
    ) -> None:
        self.model, self.admission, self.m = model, admission, m
        self.limits = model.ranker.cfg.limits
        gate = [g for g in auth_gate if isinstance(g, AuthInterceptor)]
        self.tokens = gate[0].tokens if gate else None
        self.protect_health = bool(gate and gate[0].protect_health)
        self.limit = gate[0].limit if gate else None
        self._counted: dict[tuple[str, str], Any] = {}

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._middleware], client_max_size=self.limits.max_request_bytes
        )
        get = app.router.add_get
        get("/v2", self.server_metadata)
        get("/v2/health/live", self.live)
        get("/v2/health/ready", self.ready)
        for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            get(prefix, self.model_metadata)
            get(prefix + "/ready", self.model_ready)
            app.router.add_post(prefix + "/infer", self.infer, expect_handler=self._expect)
        app.router.add_post("/v1/feedback", self.feedback)  # recsys.v1.Ranker/Feedback
        return app

    # --- the door: metrics, auth, errors -------------------------------------------------

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        resource = request.match_info.route.resource
        if resource is None or request.match_info.http_exception is not None:
            e = request.match_info.http_exception  # not counted: like gRPC's UNIMPLEMENTED
            status = e.status if e is not None else 404
            return _json({"error": f"no such endpoint: {request.method} {clip(request.path)} "
                          "(KServe v2: /v2, /v2/health/ready, /v2/models/{name}[/versions/{v}]"
                          "[/ready|/infer]; POST /v1/feedback)"}, status)  # fmt: skip
        t0 = time.perf_counter()
        m = self.m
        if m is not None:
            m.serving_now += 1
        code = grpc.StatusCode.UNKNOWN
        try:
            try:
                await self._authorize(request)
                response = await handler(request)
                code = grpc.StatusCode.OK if response.status < 400 else grpc.StatusCode.UNAVAILABLE
                return response
            except ScoreError as e:
                raise HttpError.of(e) from None
        except HttpError as e:
            code = e.code
            return _json({"error": e.message}, e.status, e.headers)
        except asyncio.CancelledError:  # the client went away
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            if m is not None:
                method = f"{request.method} {resource.canonical}"
                m.latency.labels(method).observe(time.perf_counter() - t0)
                key = (method, code.name)
                counter = self._counted.get(key)
                if counter is None:
                    counter = self._counted[key] = m.requests.labels(*key)
                counter.inc()
                m.serving_now -= 1

    def _refusal(self, request: web.Request) -> HttpError | None:
        """Why ``request`` may not call (None: it may): auth.py's rules, over HTTP."""
        if self.tokens is None or (request.path in OPEN and not self.protect_health):
            return None
        header = request.headers.get(hdrs.AUTHORIZATION)
        token = bearer_token([("authorization", header)] if header is not None else [])
        if token is not None and self.tokens.accepts(token):
            return None
        challenge = {"WWW-Authenticate": 'Bearer realm="recsys-gateway"'}
        if self.tokens.refresh():  # no token can be accepted: the log says why, not the caller
            return HttpError(401, grpc.StatusCode.UNAUTHENTICATED, UNUSABLE, **challenge)
        why = "no bearer token" if token is None else "the bearer token is not accepted"
        return HttpError(
            401, grpc.StatusCode.UNAUTHENTICATED, f"{why}: send 'Authorization: Bearer "
            "<token>' with a token of the gateway's auth.token_file", **challenge,
        )  # fmt: skip

    async def _authorize(self, request: web.Request) -> None:
        if (refused := self._refusal(request)) is not None:
            metrics.rejected("unauthenticated")
            limit = self.limit if refused.message != UNUSABLE else None  # per peer, as gRPC
            if limit is not None and (limited := await limit.refuse(request.remote or "")):
                raise HttpError(429, grpc.StatusCode.RESOURCE_EXHAUSTED, limited,
                                **{"Retry-After": "1", "Connection": "close"})  # fmt: skip
            raise refused

    def _tenant(self, request: web.Request) -> tenants.Tenant:
        if self.tokens is None:
            return tenants.DEFAULT
        header = request.headers.get(hdrs.AUTHORIZATION)
        return self.tokens.identify([("authorization", header)] if header is not None else [])

    def _too_large(self, request: web.Request) -> HttpError | None:
        n, limit = request.content_length, self.limits.max_request_bytes
        if n is None or n <= limit:
            return None
        return HttpError(
            413, grpc.StatusCode.INVALID_ARGUMENT,
            f"request is {n} bytes (Content-Length); the limit is {limit} "
            "(limits.max_request_bytes)", Connection="close",
        )  # fmt: skip

    async def _expect(self, request: web.Request) -> None:
        """``Expect: 100-continue``: the client may send its body, unless the handler will
        refuse it anyway (too large, no accepted token): then it answers without a 100."""
        if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
            raise web.HTTPExpectationFailed(text="only 'Expect: 100-continue' is understood")
        if self._too_large(request) is None and self._refusal(request) is None:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0

    # --- the routes ---------------------------------------------------------------------------

    async def live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        ready = self.model.server_ready()
        return _json({"ready": ready}, 200 if ready else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json(self.model.server_metadata())

    async def model_metadata(self, request: web.Request) -> web.Response:
        info = request.match_info
        return _json(self.model.model_metadata(info["name"], info.get("version", "")))

    async def model_ready(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        ready = self.model.model_ready(name, request.match_info.get("version", ""))
        return _json({"name": name, "ready": ready}, 200 if ready else 503)

    async def infer(self, request: web.Request) -> web.Response:
        name, version = request.match_info["name"], request.match_info.get("version", "")
        model, admission = self.model, self.admission
        if name != model.ranker.plan.model:
            model.version(name, version)  # NOT_FOUND, before the body is read
        if (too_large := self._too_large(request)) is not None:
            raise too_large  # the body stays unread (lingering_time 0: the connection closes)
        tenant = self._tenant(request)
        if admission.door_full(tenant):
            refusal = admission.door_refusal(tenant)
            await admission.pace(tenant)
            raise refusal  # the body stays unread
        who = tenants.enter(tenant)  # this task serves the tenant's call to its end
        place = admission.enter(tenant)
        try:
            wait = self.limits.read_timeout_s
            try:
                async with asyncio.timeout(wait):
                    body = await request.read()
            except TimeoutError:
                raise HttpError(
                    408, grpc.StatusCode.DEADLINE_EXCEEDED, f"the request body did not arrive "
                    f"within {wait:g} s (limits.read_timeout_s)", Connection="close",
                ) from None  # fmt: skip
            except web.HTTPRequestEntityTooLarge:  # chunked, no Content-Length
                raise HttpError(
                    413, grpc.StatusCode.INVALID_ARGUMENT, "request is over "
                    f"{self.limits.max_request_bytes} bytes (limits.max_request_bytes)",
                    Connection="close",
                ) from None  # fmt: skip
            header_length = request.headers.get(HEADER_LENGTH)
            memory.saw(len(body))
            try:
                if len(body) > OFFLOAD_BYTES:  # JSON of megabytes: parsed off the event loop,
                    # one at a time, a short queue (of JSON bytes: binary data is quick)
                    arrays, parsed = await DECODES.run(
                        lambda: decoded(model, body, header_length),
                        max(json_bytes(body, header_length), 0),
                        QUEUED_BODIES * self.limits.max_request_bytes,
                    )
                else:
                    arrays, parsed = decoded(model, body, header_length)
            except InvalidRequest as e:
                metrics.rejected("invalid")
                raise HttpError(400, grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            log = model.ranker.logs(request.headers.items())
            scored = await model.score(arrays, version, parsed.time_remaining, log)
        finally:
            admission.leave(place)
            tenants.leave(who)
        return self._reply(name, parsed, scored)

    async def feedback(self, request: web.Request) -> web.Response:
        """``POST /v1/feedback``: clicks as JSON, all or none (serving/gateway/feedback.py)."""
        ranker = self.model.ranker
        try:
            async with asyncio.timeout(self.limits.read_timeout_s):
                body = await request.read()
        except TimeoutError:
            raise HttpError(408, grpc.StatusCode.DEADLINE_EXCEEDED, "the request body did not "
                            "arrive in time (limits.read_timeout_s)", Connection="close") from None  # fmt: skip
        log = ranker.feature_log
        try:
            clicks = feedback.clicks_of(body, log.cfg.max_clicks if log else 0)
        except ValueError as e:
            if log is not None:
                log.clicks_refused["invalid"] += 1
                raise HttpError(400, grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            clicks = []  # the log is off: that is the answer, whatever the body
        return _json({"accepted": feedback.accept(log, ranker.ids, clicks)})

    def _reply(self, name: str, infer: Infer, scored: Scored) -> web.Response:
        out: dict[str, Any] = {"name": OUTPUT, "datatype": SCORES.datatype,
                               "shape": [int(scored.scores.size)]}  # fmt: skip
        doc = {"model_name": name, "model_version": scored.version, "outputs": [out],
               "parameters": scored.parameters}  # fmt: skip
        doc["id"] = reply_id(infer.id, scored.request_id)  # ours also in parameters
        headers = dict(scored.metadata)
        if not infer.binary:
            out["data"] = scored.scores.tolist()
            return _json(doc, headers=headers)
        data = scored.scores.astype(SCORES.dtype).tobytes()
        out["parameters"] = {"binary_data_size": len(data)}
        head = json.dumps(doc).encode()
        headers[HEADER_LENGTH] = str(len(head))
        return web.Response(
            body=head + data, content_type="application/octet-stream", headers=headers
        )


def ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The HTTP side of ``tls`` (mutual TLS with ``client_ca``); None = plaintext."""
    if not tls.enabled:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(tls.cert, tls.key)
    if tls.client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(tls.client_ca)
    return ctx


async def start(cfg: GatewayConfig, rest: Rest) -> tuple[web.AppRunner, int] | None:
    """Serve ``rest`` on ``cfg.host:cfg.http_port`` (on this event loop); None when off
    (-1) or when the port cannot be bound (one error line: gRPC serves on). Connections are
    capped per peer and in total (``cfg.connections``), counted from accept, with TLS done
    after the count (serving/gateway/connections.py)."""
    from serving.gateway.connections import GatedRunner, PeerGate

    if cfg.http_port < 0:
        return None
    wait, caps = cfg.limits.read_timeout_s, cfg.connections
    runner = GatedRunner(
        rest.app(), PeerGate(caps.http_max_connections, caps.http_max_per_peer),
        ssl_context(cfg.tls), caps.handshake_timeout_s,
        handle_signals=False, access_log=None, shutdown_timeout=cfg.grace_s,
        keepalive_timeout=wait, lingering_time=0,  # an unread body is never read: closed
    )  # fmt: skip
    await runner.setup()
    site = web.TCPSite(runner, cfg.host.strip("[]"), cfg.http_port)  # TLS: the runner's
    try:
        await site.start()
    except OSError as e:
        logger.error(
            "KServe v2 HTTP on %s:%d not started: %s (set http_port or RECSYS_GATEWAY_HTTP_PORT;"
            " -1 = off)", cfg.host, cfg.http_port, e.strerror or e,
        )  # fmt: skip
        await runner.cleanup()
        return None
    port = int(runner.addresses[0][1])
    logger.info("KServe v2 HTTP on %s://%s:%d/v2", "https" if cfg.tls.enabled else "http",
                cfg.host, port)  # fmt: skip
    return runner, port
