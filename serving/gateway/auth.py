"""Who may call the gateway: bearer tokens from a file, TLS and mutual TLS.

The token file (:func:`write_token_file` makes one: ``make serve``, compose's init step):
UTF-8 text, one token per line; blank lines are ignored and a word that starts with ``#``
starts a comment to the end of the line, alone on its line or after a token and whitespace
(``<token>  # issued 2026-12``; a ``#`` inside a token is part of it). A token is printable and
has no whitespace; after it a line may name the token's tenant and its weight
(``<token>  tenant=ads  weight=2``: serving/gateway/tenants.py; the gateway shares the backends
across tenants by weight, serving/gateway/fair.py). Any other word, or a control character,
makes the whole file unparsable (never half-read).

- :class:`TokenFile`: the accepted tokens are those of the file's last read. It is read again
  when it changes (serving/gateway/watched.py: inode, size, times and content, so a same-size
  edit in place counts), looked at at most once a second, on a call and on each health round;
  a token is added or revoked by editing the file, without a restart. **Fail closed**: at start
  a file that cannot be used stops the gateway (one line, exit 2); while it runs, an emptied,
  deleted, unreadable or unparsable file accepts no token: every call ends UNAUTHENTICATED
  (the log says what is wrong with the file; callers, who may have no token, are told only
  that it cannot be used), health is NOT_SERVING and ``recsys_gateway_auth_token_file_ok`` is
  0, until the file is fixed. The last good tokens are not kept then (the edit may be a
  revocation) - except after a *transient* failure to read it (:data:`TRANSIENT`: out of
  descriptors, memory, interrupted), which says nothing of the file: the last good tokens stay
  and the file is read again at the next look. Serving without tokens is a config choice only (no
  ``auth.token_file``), never the result of what the file holds. Tokens are kept as SHA-256
  digests and a presented token is compared with :func:`hmac.compare_digest` against each.
- :class:`AuthInterceptor`: a ``grpc.aio`` server interceptor; a call without
  ``authorization: Bearer <token>`` of the file ends UNAUTHENTICATED before the servicer runs
  (and before its request is read), at once within its peer's :class:`PeerLimit`, after a
  delay past it.
  Health is open unless ``auth.protect_health``; reflection is protected (it lists services).
- TLS and the exposure rule: serving/gateway/exposure.py.
- Client side: :func:`client_token` finds the token (``RECSYS_GATEWAY_TOKEN_FILE``, else the
  file ``make serve`` writes) and :func:`write_token_file` creates it (mode 0600); our tools'
  channels (TLS, mutual TLS, the token on every call) are built in serving/tools/channel.py.

``python -m serving.gateway.auth PATH`` creates a token file if there is none (compose's init step).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from recsys_stack.logs import OncePer
from serving.gateway.config import TOKEN_FILE_ENV, TOKEN_FILE_NAME, AuthConfig
from serving.gateway.filemode import check_private
from serving.gateway.peers import PeerLimit, peer_host
from serving.gateway.rpc import HandlerInterceptor
from serving.gateway.tenants import DEFAULT, Tenant, check_consistent, parse_settings
from serving.gateway.watched import TRANSIENT, WatchedFile

logger = logging.getLogger("serving.gateway.auth")
HEALTH_PREFIX = "/grpc.health.v1.Health/"
RECHECK_S = 1.0  # how often the token file is looked at, at most
TRANSIENT_LOG_S = 10.0  # a transient failure to read the token file is logged this often at most
# what a caller is told while the token file cannot be used (the log names the file and why)
UNUSABLE = (
    "the gateway's token file cannot be used: every call is refused until its operator fixes "
    "it (the gateway's log says why)"
)


class AuthError(ValueError):
    """The token file or the TLS files cannot be used (one line, names the file)."""


class TransientAuthError(AuthError):
    """The token file could not be read for a reason that says nothing of its content (no
    descriptor left, no memory, interrupted): the last good tokens stay in force."""


def parse_entries(text: str, where: str) -> list[tuple[str, Tenant]]:
    """The tokens of a token file's ``text`` with their tenants (format: the module docstring);
    AuthError naming ``where`` and the line, never the token, when a line is not one token and
    its settings."""
    entries: list[tuple[str, Tenant]] = []
    lines: list[tuple[Tenant, str]] = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        words = words[: next((i for i, w in enumerate(words) if w.startswith("#")), len(words))]
        if not words:
            continue
        if not all(w.isprintable() for w in words):
            raise AuthError(f"{where}: line {n}: control characters in the line")
        try:
            tenant = parse_settings(words[0], words[1:], f"{where}: line {n}")
        except ValueError as e:
            raise AuthError(str(e)) from None
        entries.append((words[0], tenant))
        lines.append((tenant, f"line {n}"))
    if not entries:
        raise AuthError(f"{where}: no token in it (one per line)")
    try:
        check_consistent(lines)
    except ValueError as e:
        raise AuthError(f"{where}: {e}") from None
    return entries


def parse_tokens(text: str, where: str) -> list[str]:
    """The tokens of a token file's ``text`` (:func:`parse_entries` without the tenants)."""
    return [token for token, _ in parse_entries(text, where)]


def read_entries(path: Path) -> list[tuple[str, Tenant]]:
    """The tokens of the file ``path`` and their tenants; AuthError when it cannot be read or
    parsed or has none (:class:`TransientAuthError` when the failure says nothing of the file:
    out of descriptors or memory, interrupted)."""
    where = f"auth.token_file {path}"
    try:
        text = Path(path).read_bytes().decode()
    except OSError as e:
        error = TransientAuthError if e.errno in TRANSIENT else AuthError
        raise error(f"{where}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise AuthError(f"{where}: not UTF-8 text") from None
    return parse_entries(text, where)


def read_tokens(path: Path) -> list[str]:
    """The tokens of the file ``path``; AuthError when it cannot be read or parsed or has none."""
    return [token for token, _ in read_entries(path)]


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


def _report(path: str, ok: bool) -> None:
    # imported here, on the gateway's side only: clients of this module (the Locust image)
    # run without prometheus_client
    from serving.gateway import metrics

    metrics.token_file(path, ok)


class TokenFile:
    """The tokens of the file's last read and their tenants, read again when it changes; none
    while the file cannot be used (:attr:`problem` says why)."""

    def __init__(self, path: Path, recheck_s: float = RECHECK_S) -> None:
        self.path = Path(path)
        self.recheck_s = recheck_s
        self.problem = ""
        """Why no token is accepted ("" = the file's tokens are in force); for the log and
        health, never for callers (it names the file)."""
        self._file = WatchedFile(self.path)
        self._file.mark()
        self._digests = _digests(read_entries(self.path))  # or not started
        self._label = os.path.abspath(self.path)  # the metric's (not resolved: a rotated link)
        self._next_check = time.monotonic() + recheck_s
        self._transient_log = OncePer(TRANSIENT_LOG_S)
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
            entries = read_entries(self.path)
        except TransientAuthError as e:
            # not a verdict on the file (1,100 idle connections used every descriptor, and
            # every valid call was refused): keep the last good tokens, read again next look
            self._file.forget()
            if self._transient_log.ready() is not None:
                logger.warning("%s: keeping the tokens of its last read, trying again", e)
            return
        except AuthError as e:
            self._digests = []  # fail closed: the edit that broke the file may be a revocation
            self.problem = (
                f"{e}: every call is refused until the file holds one token per line ('#' "
                "comments allowed; it is re-read when it changes)"
            )
            logger.error("%s", self.problem)
            _report(self._label, ok=False)
            return
        self._digests = _digests(entries)
        logger.info(
            "auth: re-read %s (%d tokens, %d tenants)%s", self.path, len(entries),
            len({t.name for _, t in entries}), "; calls are accepted again" if self.problem else "",
        )  # fmt: skip
        self.problem = ""
        _report(self._label, ok=True)

    def tenant_of(self, token: bytes) -> Tenant | None:
        """The tenant of ``token`` if it is one of the file's, else None (constant time per
        stored token: every digest is compared, whichever matches)."""
        self.refresh()
        d = _digest(token)
        found = None
        for stored, tenant in self._digests:  # no early exit: time does not say which matched
            if hmac.compare_digest(d, stored):
                found = tenant
        return found

    def accepts(self, token: bytes) -> bool:
        """True when ``token`` is one of the file's."""
        return self.tenant_of(token) is not None

    def identify(self, metadata: Sequence[tuple[str, Any]] | None) -> Tenant:
        """The tenant of a call's ``authorization`` metadata (calls reaching the door passed
        auth; one whose token was revoked in between is :data:`tenants.DEFAULT`'s)."""
        token = bearer_token(metadata)
        return (self.tenant_of(token) if token is not None else None) or DEFAULT


def _digests(entries: list[tuple[str, Tenant]]) -> list[tuple[bytes, Tenant]]:
    return [(_digest(token.encode()), tenant) for token, tenant in entries]


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> bytes | None:
    """The token of an ``authorization: Bearer <token>`` entry, or None."""
    for key, value in metadata or ():
        if key == "authorization":
            raw = value.encode() if isinstance(value, str) else bytes(value)
            scheme, _, token = raw.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


def _denier(
    handler: grpc.RpcMethodHandler, message: str, limit: PeerLimit | None = None
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED (after the
    peer's :class:`PeerLimit`, when given: RESOURCE_EXHAUSTED past its bucket)."""
    from serving.gateway import metrics  # the gateway's side only (see _report)

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        metrics.rejected("unauthenticated")
        if limit is not None and (limited := await limit.refuse(peer_host(context.peer()))):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, limited)
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await unary(request, context)
        yield  # pragma: no cover  (makes this an async generator)

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, des, ser)
    if handler.stream_unary:  # the request is never read: refused before its upload
        return grpc.stream_unary_rpc_method_handler(unary, None, ser)
    return grpc.stream_stream_rpc_method_handler(stream, None, ser)


class AuthInterceptor(HandlerInterceptor):
    """UNAUTHENTICATED for a call without a token of ``tokens`` (health open unless
    ``protect_health``), rate-limited per peer (``limit``). Per call: one metadata scan, one
    SHA-256, one compare per token."""

    def __init__(
        self, tokens: TokenFile, protect_health: bool = False, limit: PeerLimit | None = None
    ) -> None:
        self.tokens = tokens
        self.protect_health = protect_health
        self.limit = limit
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
        if self.tokens.refresh():  # no token can be accepted: the log says why, not the caller
            why, limit = UNUSABLE, None
        else:
            why = "no bearer token" if token is None else "the bearer token is not accepted"
            why += ": send 'authorization: Bearer <token>' with a token of the gateway's "
            why += "auth.token_file"
            limit = self.limit
        key = (method, why)  # the message is part of the handler: one per method and reason
        denier = self._deniers.get(key)
        if denier is None:
            denier = self._deniers[key] = _denier(handler, why, limit)
        return denier

    def identify(self, metadata: Sequence[tuple[str, Any]] | None) -> Tenant:
        return self.tokens.identify(metadata)


def refusal(gate: Sequence[HandlerInterceptor]) -> str:
    """Why the auth interceptors ``gate`` (:func:`interceptors`) refuse every call now ("" =
    they do not): the health poller reports NOT_SERVING with it."""
    for interceptor in gate:
        if isinstance(interceptor, AuthInterceptor) and (problem := interceptor.tokens.refresh()):
            return problem
    return ""


def interceptors(auth: AuthConfig) -> list[HandlerInterceptor]:
    """The auth interceptor when a token file is configured (raises AuthError if unusable)."""
    if not auth.token_file:
        return []
    refusal, warning = check_private(auth.token_file)  # serving/gateway/filemode.py
    if refusal:  # anyone could add a token: refused, as ssh refuses an open private key
        raise AuthError(f"auth.token_file {refusal}")
    if warning:
        logger.warning("auth.token_file %s", warning)
    limit = PeerLimit(
        auth.unauthenticated_rate, auth.unauthenticated_burst, auth.unauthenticated_delay_s
    )
    return [AuthInterceptor(TokenFile(Path(auth.token_file)), auth.protect_health, limit)]


def identifier(gate: Sequence[HandlerInterceptor]) -> Callable[[Any], Tenant]:
    """Who a call is (its tenant) from its metadata: the auth interceptor of ``gate`` knows;
    without one every call is :data:`tenants.DEFAULT`."""
    for interceptor in gate:
        if isinstance(interceptor, AuthInterceptor):
            return interceptor.identify
    return lambda metadata: DEFAULT


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
