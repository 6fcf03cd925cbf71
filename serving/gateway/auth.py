"""Who may call the gateway: bearer tokens from a file, TLS and mutual TLS.

The token file (:func:`write_token_file` makes one: ``make serve``, compose's init step):
UTF-8 text, one token per line; blank lines are ignored and a word that starts with ``#``
starts a comment to the end of the line, alone on its line or after a token and whitespace
(``<token>  # issued 2026-12``; a ``#`` inside a token is part of it). A token is printable and
has no whitespace: a line of two words, or a control character, makes the whole file
unparsable (never half-read).

- :class:`TokenFile`: the accepted tokens are those of the file's last read. It is read again
  when it changes (serving/gateway/watched.py: inode, size, times and content, so a same-size
  edit in place counts), looked at at most once a second, on a call and on each health round;
  a token is added or revoked by editing the file, without a restart. **Fail closed**: at start
  a file that cannot be used stops the gateway (one line, exit 2); while it runs, an emptied,
  deleted, unreadable or unparsable file accepts no token: every call ends UNAUTHENTICATED
  saying what is wrong with the file, health is NOT_SERVING and
  ``recsys_gateway_auth_token_file_ok`` is 0, until the file is fixed. The last good tokens are
  never kept (the edit may be a revocation). Serving without tokens is a config choice only (no
  ``auth.token_file``), never the result of what the file holds. Tokens are kept as SHA-256
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
from serving.gateway.watched import WatchedFile

logger = logging.getLogger("serving.gateway.auth")
HEALTH_PREFIX = "/grpc.health.v1.Health/"
RECHECK_S = 1.0  # how often the token file is looked at, at most


class AuthError(ValueError):
    """The token file or the TLS files cannot be used (one line, names the file)."""


def parse_tokens(text: str, where: str) -> list[str]:
    """The tokens of a token file's ``text`` (format: the module docstring); AuthError naming
    ``where`` and the line, never the token, when a line is not one token."""
    tokens = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        words = words[: next((i for i, w in enumerate(words) if w.startswith("#")), len(words))]
        if len(words) > 1:
            raise AuthError(
                f"{where}: line {n}: more than one word (one token per line; a comment starts "
                "with '#' after whitespace)"
            )
        if words and not words[0].isprintable():
            raise AuthError(f"{where}: line {n}: control characters in the token")
        tokens += words
    if not tokens:
        raise AuthError(f"{where}: no token in it (one per line)")
    return tokens


def read_tokens(path: Path) -> list[str]:
    """The tokens of the file ``path``; AuthError when it cannot be read or parsed or has none."""
    where = f"auth.token_file {path}"
    try:
        text = Path(path).read_bytes().decode()
    except OSError as e:
        raise AuthError(f"{where}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise AuthError(f"{where}: not UTF-8 text") from None
    return parse_tokens(text, where)


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _report(path: str, ok: bool) -> None:
    # imported here, on the gateway's side only: clients of this module (the Locust image)
    # run without prometheus_client
    from serving.gateway import metrics

    metrics.token_file(path, ok)


class TokenFile:
    """The tokens of the file's last read, read again when it changes; none while the file
    cannot be used (:attr:`problem` says why)."""

    def __init__(self, path: Path, recheck_s: float = RECHECK_S) -> None:
        self.path = Path(path)
        self.recheck_s = recheck_s
        self.problem = ""
        """Why no token is accepted ("" = the file's tokens are in force)."""
        self._file = WatchedFile(self.path)
        self._file.mark()
        self._digests = [_digest(t.encode()) for t in read_tokens(self.path)]  # or not started
        self._label = os.path.abspath(self.path)  # the metric's (not resolved: a rotated link)
        self._next_check = time.monotonic() + recheck_s
        _report(self._label, ok=True)

    def refresh(self) -> str:
        """Read the file again if it changed (looked at once per ``recheck_s`` at most);
        :attr:`problem` then."""
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.recheck_s
            if self._file.changed():
                self._reload()
        return self.problem

    def _reload(self) -> None:
        self._file.mark()  # before reading: a write meanwhile is seen by the next look
        try:
            tokens = read_tokens(self.path)
        except AuthError as e:
            self._digests = []  # fail closed: the edit that broke the file may be a revocation
            self.problem = (
                f"{e}: every call is refused until the file holds one token per line ('#' "
                "comments allowed; it is re-read when it changes)"
            )
            logger.error("%s", self.problem)
            _report(self._label, ok=False)
            return
        self._digests = [_digest(t.encode()) for t in tokens]
        logger.info(
            "auth: re-read %s (%d tokens)%s", self.path, len(tokens),
            "; calls are accepted again" if self.problem else "",
        )  # fmt: skip
        self.problem = ""
        _report(self._label, ok=True)

    def accepts(self, token: bytes) -> bool:
        """True when ``token`` is one of the file's (constant time per stored token)."""
        self.refresh()
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
    from serving.gateway import metrics  # the gateway's side only (see _report)

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
        if problem := self.tokens.refresh():  # no token can be accepted: say why
            return _denier(handler, problem)  # not cached: its text changes with the file
        why = "no bearer token" if token is None else "the bearer token is not accepted"
        key = (method, why)  # the message is part of the handler: one per method and reason
        denier = self._deniers.get(key)
        if denier is None:
            denier = self._deniers[key] = _denier(
                handler, f"{why}: send 'authorization: Bearer <token>' with a token of the "
                "gateway's auth.token_file",
            )  # fmt: skip
        return denier


def refusal(gate: Sequence[HandlerInterceptor]) -> str:
    """Why the auth interceptors ``gate`` (:func:`interceptors`) refuse every call now ("" =
    they do not): the health poller reports NOT_SERVING with it."""
    for interceptor in gate:
        if isinstance(interceptor, AuthInterceptor) and (problem := interceptor.tokens.refresh()):
            return problem
    return ""


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
