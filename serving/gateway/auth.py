"""Who may call the gateway: bearer tokens from a file, TLS and mutual TLS.

- :class:`TokenFile`: the accepted tokens, one per line (``#`` comments and blank lines
  ignored), re-read when the file's mtime/size change (checked at most once a second), so a
  token is added or revoked by editing the file, without a restart. Tokens are kept as SHA-256
  digests and a presented token is compared with :func:`hmac.compare_digest` against each.
- :class:`AuthInterceptor`: a ``grpc.aio`` server interceptor; a call without
  ``authorization: Bearer <token>`` of the file ends UNAUTHENTICATED before the servicer runs.
  Health is open unless ``auth.protect_health``; reflection is protected (it lists services).
- :func:`server_credentials`: TLS (``cert`` + ``key``) or mutual TLS (+ ``client_ca``).
- :func:`check_exposure`: the gateway refuses to start on a non-loopback host with no token
  file unless ``auth.allow_unauthenticated``.
- Client side: :func:`client_token` finds the token (``RECSYS_GATEWAY_TOKEN_FILE``, else the
  file ``make serve`` writes) and :func:`write_token_file` creates it (mode 0600); our tools'
  channels (TLS, mutual TLS, the token on every call) are built in serving/tools/channel.py.

``python -m serving.gateway.auth PATH`` creates a token file if there is none (compose's init step).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from serving.gateway.config import TOKEN_FILE_ENV, TOKEN_FILE_NAME, AuthConfig, TlsConfig
from serving.gateway.rpc import HandlerInterceptor

logger = logging.getLogger("serving.gateway.auth")
HEALTH_PREFIX = "/grpc.health.v1.Health/"
RECHECK_S = 1.0  # how often the token file's stat is looked at, at most


class AuthError(ValueError):
    """The token file or the TLS files cannot be used (one line, names the file)."""


def read_tokens(path: Path) -> list[str]:
    """The tokens of ``path``: one per line, ``#`` comments and blank lines ignored."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise AuthError(f"auth.token_file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise AuthError(f"auth.token_file {path}: not UTF-8 text") from None
    tokens = [ln.strip() for ln in text.splitlines()]
    tokens = [t for t in tokens if t and not t.startswith("#")]
    for n, t in enumerate(tokens, 1):
        if any(c.isspace() for c in t) or not t.isprintable():
            raise AuthError(f"auth.token_file {path}: token {n} has spaces or control characters")
    if not tokens:
        raise AuthError(f"auth.token_file {path}: no token in it (one per line)")
    return tokens


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


class TokenFile:
    """Accepted tokens, re-read when the file changes; a bad edit keeps the last good set."""

    def __init__(self, path: Path, recheck_s: float = RECHECK_S) -> None:
        self.path = Path(path)
        self.recheck_s = recheck_s
        self._digests = [_digest(t.encode()) for t in read_tokens(self.path)]
        self._stamp = self._stat()
        self._next_check = time.monotonic() + recheck_s

    def _stat(self) -> tuple[int, int]:
        try:
            st = self.path.stat()
        except OSError:
            return (-1, -1)
        return (st.st_mtime_ns, st.st_size)

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.recheck_s
        stamp = self._stat()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._digests = [_digest(t.encode()) for t in read_tokens(self.path)]
            logger.info("auth: re-read %s (%d tokens)", self.path, len(self._digests))
        except AuthError as e:
            logger.error("%s; keeping the previous %d tokens", e, len(self._digests))

    def accepts(self, token: bytes) -> bool:
        """True when ``token`` is one of the file's (constant time per stored token)."""
        self._maybe_reload()
        d = _digest(token)
        ok = False
        for stored in self._digests:  # no early exit: time does not say which one matched
            ok |= hmac.compare_digest(d, stored)
        return ok


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> bytes | None:
    """The token of an ``authorization: Bearer <token>`` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            raw = value.encode() if isinstance(value, str) else bytes(value)
            scheme, _, token = raw.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def _denier(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED."""
    # imported here, on the gateway's side only: clients of this module (the Locust image)
    # run without prometheus_client
    from serving.gateway import metrics

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        metrics.rejected("unauthenticated")
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        metrics.rejected("unauthenticated")
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (makes this an async generator)

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    return grpc.stream_stream_rpc_method_handler(stream, des, ser)


class AuthInterceptor(HandlerInterceptor):
    """UNAUTHENTICATED for a call without a token of ``tokens`` (health open unless
    ``protect_health``). Per call: one metadata scan, one SHA-256, one compare per token."""

    def __init__(self, tokens: TokenFile, protect_health: bool = False) -> None:
        self.tokens = tokens
        self.protect_health = protect_health
        self._deniers: dict[tuple[str, str], grpc.RpcMethodHandler] = {}

    def apply(self, details: grpc.HandlerCallDetails, handler: grpc.RpcMethodHandler) -> Any:
        """``handler`` for a call with an accepted token (or to open health), else one that
        ends it UNAUTHENTICATED (unknown methods never get here: UNIMPLEMENTED says nothing
        secret)."""
        method = details.method
        if not self.protect_health and method.startswith(HEALTH_PREFIX):
            return handler
        token = bearer_token(details.invocation_metadata)
        if token is not None and self.tokens.accepts(token):
            return handler
        why = "no bearer token" if token is None else "the bearer token is not accepted"
        key = (method, why)  # the message is part of the handler: one per method and reason
        denier = self._deniers.get(key)
        if denier is None:
            denier = self._deniers[key] = _denier(
                handler, f"{why}: send 'authorization: Bearer <token>' with a token of the "
                "gateway's auth.token_file",
            )  # fmt: skip
        return denier


def read_pem(key: str, path: str) -> bytes:
    """The bytes of the PEM file ``path``; AuthError naming the config ``key`` and the file."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise AuthError(f"{key} {path}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise AuthError(f"{key} {path}: not a PEM file")
    return data


def server_credentials(tls: TlsConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for ``tls`` (mutual TLS when ``client_ca`` is set); None = plaintext."""
    if not tls.enabled:
        return None
    pair = (read_pem("tls.key", tls.key), read_pem("tls.cert", tls.cert))
    if tls.client_ca:
        ca = read_pem("tls.client_ca", tls.client_ca)
        return grpc.ssl_server_credentials([pair], ca, require_client_auth=True)
    return grpc.ssl_server_credentials([pair])


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; False for wildcards and other addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, auth: AuthConfig) -> None:
    """Refuse (AuthError) to serve a non-loopback ``host`` without a token file."""
    if auth.token_file or auth.allow_unauthenticated or is_loopback(host):
        return
    raise AuthError(
        f"host {host} is reachable from other machines but auth.token_file is not set: set "
        f"{TOKEN_FILE_ENV} (or --auth.token-file) to a file of tokens, or pass "
        "auth.allow_unauthenticated=true to serve without authentication"
    )


def interceptors(auth: AuthConfig) -> list[HandlerInterceptor]:
    """The auth interceptor when a token file is configured (raises AuthError if unusable)."""
    if not auth.token_file:
        return []
    return [AuthInterceptor(TokenFile(Path(auth.token_file)), auth.protect_health)]


# --- client side -----------------------------------------------------------------------------


def default_token_file() -> Path:
    """Where ``make serve`` writes the token: ``$RECSYS_SERVE_DIR/gateway_token``."""
    return Path(os.environ.get("RECSYS_SERVE_DIR") or "runs/serve") / TOKEN_FILE_NAME


def client_token(token_file: str = "") -> str | None:
    """The first token of ``token_file``, else of ``$RECSYS_GATEWAY_TOKEN_FILE``, else of
    :func:`default_token_file` when it exists; None = call without a token."""
    path = token_file or os.environ.get(TOKEN_FILE_ENV, "")
    if path:
        return read_tokens(Path(path))[0]
    default = default_token_file()
    return read_tokens(default)[0] if default.is_file() else None


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``token`` (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def write_token_file(path: Path) -> bool:
    """Create ``path`` with one random token, mode 0600; False if it already exists (kept, so
    clients holding it keep working across restarts)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m serving.gateway.auth PATH``: create a token file (mode 0600) unless one exists."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["-h"], ["--help"]):
        print(main.__doc__)
        return 0
    if len(args) != 1 or args[0].startswith("-"):
        print(f"error: expected one PATH. {main.__doc__}", file=sys.stderr)
        return 2
    path = Path(args[0])
    made = write_token_file(path)
    print(f"{'created' if made else 'kept existing'} token file {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
