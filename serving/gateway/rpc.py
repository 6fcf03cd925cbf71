"""Registering generated gRPC servicers so that bytes that do not parse are INVALID_ARGUMENT.

grpc's Python server deserializes a request before the servicer runs; when the bytes are not a
valid message it answers ``UNKNOWN: Unexpected <class 'DecodeError'>``, which tells the caller
nothing and reads as a server bug. :func:`add_servicer` registers a servicer through its
generated ``add_XServicer_to_server`` function but with a deserializer that never raises: bytes
that do not parse become an :class:`Undecodable` and the call ends with INVALID_ARGUMENT naming
the message type, before the servicer's method runs. Works for any generated service (the
``recsys.v1`` ranker, KServe v2).

The gateway's interceptors (metrics, auth, admission) only pick a call's handler
(:class:`HandlerInterceptor`); :class:`Chain` runs several as one and :class:`Routes` applies
them from a generic handler, so the server needs no grpc interceptor at all.

:func:`quiet_core_errors` makes grpc's own report of an answer to a call core had already ended
(a message over ``grpc.max_receive_message_length``) one DEBUG line instead of a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class Undecodable:
    """What the deserializer returns for bytes that are not a ``message`` (never raised)."""

    def __init__(self, message: str, size: int, error: str) -> None:
        self.text = f"the request is not a valid {message} ({size} bytes): {error}"


def safe_deserializer(parse: Callable[[bytes], Any], message: str) -> Callable[[bytes], Any]:
    """``parse`` that returns an :class:`Undecodable` instead of raising ``DecodeError``."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except (DecodeError, RuntimeError, ValueError) as e:  # upb raises DecodeError
            return Undecodable(message, len(data), str(e)[:200] or type(e).__name__)

    return deserialize


def _guard(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.text)
        return await behavior(request, context)

    return call


class _Capture:
    """Stands in for the server inside a generated ``add_XServicer_to_server``."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the registered handlers below carry the same methods

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_servicer(
    server: grpc.aio.Server,
    add: Callable[[Any, Any], None],
    servicer: Any,
    raw: Collection[str] = (),
) -> str:
    """``add(servicer, server)`` with parse errors mapped to INVALID_ARGUMENT (unary-unary
    methods; others are registered unchanged); the methods named in ``raw`` receive the
    request's bytes and parse them themselves, and return the response's bytes. Returns the
    service's full name."""
    capture = _Capture()
    add(servicer, capture)
    handlers = {}
    for name, h in capture.handlers.items():
        if name in raw:  # bytes in, bytes out
            h = h._replace(  # type: ignore[attr-defined]
                request_deserializer=None, response_serializer=None
            )
        elif h.unary_unary is not None and h.request_deserializer is not None:
            owner = getattr(h.request_deserializer, "__self__", None)
            message = owner.DESCRIPTOR.full_name if owner is not None else name
            h = h._replace(  # type: ignore[attr-defined]
                unary_unary=_guard(h.unary_unary),
                request_deserializer=safe_deserializer(h.request_deserializer, message),
            )
        handlers[name] = h
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(capture.service, handlers),)
    )
    server.add_registered_method_handlers(capture.service, handlers)
    return capture.service


class HandlerInterceptor:
    """An interceptor that only picks the handler of a call (:meth:`apply`, synchronous), so
    that several run as one (:class:`Chain`) from :class:`Routes`' lookup."""

    def apply(self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler) -> Any:
        """The handler this interceptor makes of ``handler`` for the call ``details``."""
        raise NotImplementedError


class Chain(HandlerInterceptor):
    """Several :class:`HandlerInterceptor` as one: the handler passes through each, innermost
    first. Listed outermost first, like ``grpc.aio.server(interceptors=...)``."""

    def __init__(self, *layers: HandlerInterceptor) -> None:
        self.layers = layers[::-1]

    def apply(self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler) -> Any:
        for layer in self.layers:
            handler = layer.apply(details, handler)
        return handler


class WrappingInterceptor(HandlerInterceptor):
    """An interceptor that replaces some methods' handlers by wrapped ones, each made once per
    handler object (per call: one dict lookup). Subclasses say which (:meth:`wraps`) and how
    (:meth:`wrap`)."""

    def __init__(self) -> None:
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def wraps(self, method: str, handler: grpc.RpcMethodHandler) -> bool:
        raise NotImplementedError

    def wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        raise NotImplementedError

    def apply(self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler) -> Any:
        if not self.wraps(details.method, handler):
            return handler
        hit = self._wrapped.get(id(handler))
        if hit is None or hit[0] is not handler:
            hit = self._wrapped[id(handler)] = (handler, self.wrap(details.method, handler))
        return hit[1]


class Routes(grpc.GenericRpcHandler):
    """Every service of a server behind one synchronous lookup that applies ``chain`` itself.

    Stands in for the server in the generated ``add_XServicer_to_server`` functions (and
    :func:`add_servicer`); then ``server.add_generic_rpc_handlers((routes,))``, with no server
    interceptors. grpc.aio runs server interceptors as a pipeline of coroutines it awaits on
    every call, ~20-30 us of CPU and latency per call on the 2-core machine; a generic
    handler's ``service`` is one plain call (docs/bench.md)."""

    def __init__(self, chain: HandlerInterceptor | None = None) -> None:
        self.chain = chain
        self.methods: dict[str, grpc.RpcMethodHandler] = {}
        self.generic: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)  # what the registered methods below do not cover

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        self.methods.update((f"/{service}/{name}", h) for name, h in handlers.items())

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self.methods.get(details.method)
        if handler is None:
            for generic in self.generic:
                if (handler := generic.service(details)) is not None:
                    break
            else:
                return None  # UNIMPLEMENTED, before any interceptor: it says nothing secret
        return handler if self.chain is None else self.chain.apply(details, handler)


# grpc.aio's logger, and the start of what it logs when a handler's answer cannot be sent
GRPC_CORE_LOGGER = "grpc._cython.cygrpc"
BATCH_ERROR = "ExecuteBatchError raised in core"


class _OneLine(logging.Filter):
    """grpc.aio's ``ExecuteBatchError raised in core by servicer method [m]`` (ERROR, a 1.5 KB
    traceback) -> one DEBUG line. It comes when a handler answers a call grpc core has already
    ended: a message over ``grpc.max_receive_message_length`` (core answered the client
    RESOURCE_EXHAUSTED; the admission gate, finding no message, aborts after it). The client
    has its status; a refusal is a count (metrics), not a log line, whoever sends it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(BATCH_ERROR):
            return True
        record.msg = "%s: grpc core had ended the call (e.g. a message over its size limit)"
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_core_errors() -> None:
    """Install :class:`_OneLine` on grpc.aio's logger (once)."""
    logger = logging.getLogger(GRPC_CORE_LOGGER)
    if not any(isinstance(f, _OneLine) for f in logger.filters):
        logger.addFilter(_OneLine())
