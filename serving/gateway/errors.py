"""Errors every API of the gateway reports with the same gRPC status code, and how
TorchServe's failures map to them."""

from __future__ import annotations

import grpc


class ScoreError(Exception):
    """A scoring call that failed, with the gRPC status code every API reports it as."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_UNAVAILABLE_HINTS = ("worker", "not found", "unavailable", "503", "no worker", "connect")


class BackendError(Exception):
    """A failed backend call, already mapped to the gateway's status code; ``retry``: another
    backend may take it (an outage that failed fast, not a timeout)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry = retry


def map_backend_error(
    e: grpc.aio.AioRpcError, client_bound: bool = False, deadline_s: float = 0.0
) -> tuple[grpc.StatusCode, str]:
    """TorchServe's status -> ours.

    Outages are UNAVAILABLE (retryable): connection refused, a model without a live worker, and
    no answer within the gateway's own backend deadline (as proxies map an upstream timeout).
    DEADLINE_EXCEEDED only when the client's deadline was the one that ran out.
    """
    code, details = e.code(), (e.details() or "").strip()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        if client_bound:
            return code, "the call's deadline passed while TorchServe was scoring"
        return grpc.StatusCode.UNAVAILABLE, (
            f"TorchServe did not answer within {deadline_s:g}s: its workers are down, restarting or overloaded"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return code, f"TorchServe is unreachable: {details or code.name}"
    if code == grpc.StatusCode.PERMISSION_DENIED:  # keys rotate when TorchServe restarts
        return grpc.StatusCode.UNAVAILABLE, f"TorchServe refused the gateway's key: {details}"
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.CANCELLED) or any(
        h in details.lower() for h in _UNAVAILABLE_HINTS
    ):
        return grpc.StatusCode.UNAVAILABLE, f"TorchServe: {details or code.name}"
    return grpc.StatusCode.INTERNAL, f"TorchServe failed: {code.name}: {details}"
